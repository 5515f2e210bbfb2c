use super::*;

fn config() -> ModelConfig {
    let j = serde_json::json!({"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":16,"num_hidden_layers":1,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"rms_norm_eps":1e-5,"vocab_size":16,
        "max_position_embeddings":64,"rope_theta":10000.0,"bos_token_id":0,"eos_token_id":1});
    match ModelConfig::from_hf(&j, None) {
        Ok(c) => c,
        Err(e) => panic!("config: {e}"),
    }
}

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut z = seed;
    (0..n)
        .map(|_| {
            z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn f32_weight(name: &str, shape: &[usize], v: &[f32]) -> HostWeight {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    HostWeight { name: name.into(), ty: WeightType::F32, shape: shape.to_vec(), storage: Storage::Owned(Arc::new(bytes)), x8: None }
}

/// K and Q (after a RoPE rotation of every pair) of each input, and every query head's q·k.
fn attend(c: &ModelConfig, w: &WeightSet, xs: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<u32>) {
    let (hid, hd, half) = (c.hidden_size, c.head_dim, c.head_dim / 2);
    let get = |k| w.get(k).map(HostWeight::to_f32).unwrap_or_default();
    let (g, wq, wk, bq, bk) = (get(WeightKey::AttnNorm(0)), get(WeightKey::Q(0)), get(WeightKey::K(0)), get(WeightKey::QBias(0)), get(WeightKey::KBias(0)));
    let proj = |m: &[f32], b: &[f32], h: &[f32]| -> Vec<f32> {
        let mut out: Vec<f32> = m.chunks(hid).map(|row| row.iter().zip(h).fold(0f32, |s, (a, x)| s + a * x)).collect();
        out.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        out
    };
    let rope = |v: &mut [f32], pos: usize| {
        for head in v.chunks_mut(hd) {
            for p in 0..half {
                let th = pos as f32 * 10000f32.powf(-((2 * p) as f32) / hd as f32);
                let (s, co) = th.sin_cos();
                let (a, b) = (head[p], head[p + half]);
                head[p] = a * co - b * s;
                head[p + half] = b * co + a * s;
            }
        }
    };
    let (mut ks, mut dots) = (Vec::new(), Vec::new());
    for (pos, x) in xs.iter().enumerate() {
        let h: Vec<f32> = x.iter().zip(&g).map(|(a, b)| a * b).collect();
        let (mut q, mut k) = (proj(&wq, &bq, &h), proj(&wk, &bk, &h));
        rope(&mut q, pos + 3);
        rope(&mut k, pos + 1);
        let group = c.n_heads / c.n_kv_heads;
        for qh in 0..c.n_heads {
            let (qv, kv) = (&q[qh * hd..(qh + 1) * hd], &k[(qh / group) * hd..(qh / group + 1) * hd]);
            dots.push(qv.iter().zip(kv).fold(0f32, |s, (a, b)| s + a * b).to_bits());
        }
        ks.push(k);
    }
    (ks, dots)
}

/// Per KV head: the largest channel's max |k| over the median channel's.
fn spread(c: &ModelConfig, ks: &[Vec<f32>]) -> f32 {
    let hd = c.head_dim;
    (0..c.n_kv_heads)
        .map(|g| {
            let mut m: Vec<f32> = (0..hd).map(|ch| ks.iter().map(|k| k[g * hd + ch].abs()).fold(0f32, f32::max)).collect();
            m.sort_by(f32::total_cmp);
            m[hd - 1] / m[hd / 2]
        })
        .fold(0f32, f32::max)
}

#[test]
fn fold_keeps_qk_bitwise_and_shrinks_k_spread() {
    let c = config();
    let (hid, hd) = (c.hidden_size, c.head_dim);
    let mut wk = values(1, c.kv_dim() * hid);
    // Outlier channels: the pair (1, 5) of KV head 0 and (3, 7) of KV head 1, 20x and 40x.
    for (ch, f) in [(1, 20.0), (5, 20.0), (hd + 3, 40.0), (hd + 7, 40.0)] {
        wk[ch * hid..(ch + 1) * hid].iter_mut().for_each(|v| *v *= f);
    }
    let mut w = WeightSet::default();
    let gain: Vec<f32> = values(2, hid).iter().map(|v| 1.0 + 0.25 * v).collect();
    w.tensors.insert(WeightKey::AttnNorm(0), f32_weight("norm", &[hid], &gain));
    w.tensors.insert(WeightKey::Q(0), f32_weight("q", &[c.q_dim(), hid], &values(3, c.q_dim() * hid)));
    w.tensors.insert(WeightKey::K(0), f32_weight("k", &[c.kv_dim(), hid], &wk));
    w.tensors.insert(WeightKey::QBias(0), f32_weight("qb", &[c.q_dim()], &values(4, c.q_dim())));
    w.tensors.insert(WeightKey::KBias(0), f32_weight("kb", &[c.kv_dim()], &values(5, c.kv_dim())));
    let xs: Vec<Vec<f32>> = (0..16).map(|i| values(100 + i, hid)).collect();
    let (k0, d0) = attend(&c, &w, &xs);
    let basis = match fold(&c, &mut w) {
        Ok(b) => b,
        Err(e) => panic!("fold: {e}"),
    };
    let (k1, d1) = attend(&c, &w, &xs);
    assert_eq!(d0, d1, "q·k must be bitwise unchanged");
    let e = &basis.exps[0];
    assert!(e[1] >= 3 && e[1] == e[5] && e[hd + 3] >= 4 && e[hd + 3] == e[hd + 7], "outlier pairs scaled: {e:?}");
    assert_eq!(e[0], 0);
    let (before, after) = (spread(&c, &k0), spread(&c, &k1));
    assert!(after * 4.0 < before, "K's channel spread {before} -> {after}");
    assert_ne!(basis.tag(), KBasis { exps: vec![vec![0; c.kv_dim()]] }.tag());
}

#[test]
fn block_scales_scale_exactly_or_refuse() {
    // Two Q4_1 rows of 64: d, m and nibbles per block.
    let mut bytes = Vec::new();
    for (b, nib) in (0..4).zip(values(7, 4)) {
        bytes.extend(half::f16::from_f32(0.01 + 0.001 * b as f32).to_le_bytes());
        bytes.extend(half::f16::from_f32(-0.05 * (b as f32 - 1.5)).to_le_bytes());
        bytes.extend((0..16).map(|i| ((i as f32 * 7.0 + nib * 100.0).abs() as u32 % 256) as u8));
    }
    let t = HostWeight { name: "q".into(), ty: WeightType::Q4_1, shape: vec![2, 64], storage: Storage::Owned(Arc::new(bytes.clone())), x8: None };
    let orig = t.to_f32();
    for e in [-3, 2] {
        let mut b = bytes.clone();
        for r in 0..2 {
            let Some(new) = scaled_row(&t, &b, r, e) else { panic!("row {r} by 2^{e} refused") };
            b[r * 40..(r + 1) * 40].copy_from_slice(&new);
        }
        let mut got = vec![0f32; 128];
        ferry_quant::dequantize(WeightType::Q4_1, &b, &mut got);
        let want: Vec<u32> = orig.iter().map(|v| (v * 2f32.powi(e)).to_bits()).collect();
        assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "2^{e}");
    }
    // A scale near f16's smallest normal cannot be halved 8 times exactly.
    assert!(scaled_row(&t, &bytes, 0, -12).is_none());
}

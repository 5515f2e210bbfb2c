//! Rotary position embedding frequencies (RoFormer, arXiv:2104.09864), with Llama-3's
//! frequency-dependent scaling and GGUF's per-frequency factors, computed as HF transformers does.

use crate::config::{FreqDtype, RopeConfig};

#[derive(Clone, Debug)]
pub struct RopeTable {
    /// One inverse frequency per rotated pair (head_dim / 2).
    pub inv_freq: Vec<f32>,
}

impl RopeTable {
    pub fn new(cfg: &RopeConfig, head_dim: usize) -> Self {
        let half = head_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / (cfg.theta as f64).powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        if let Some(s) = cfg.llama3 {
            let low_wavelen = s.original_max_position / s.low_freq_factor;
            let high_wavelen = s.original_max_position / s.high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        if let Some(factors) = &cfg.freq_factors {
            for (f, d) in inv_freq.iter_mut().zip(factors) {
                *f /= d;
            }
        }
        // HF keeps `inv_freq` as a buffer that is cast with the model: a checkpoint stored in
        // bf16/f16 ends up with frequencies rounded to that type, even when run in f32 math.
        match cfg.freq_dtype {
            FreqDtype::F32 => {}
            FreqDtype::BF16 => inv_freq.iter_mut().for_each(|f| *f = half::bf16::from_f32(*f).to_f32()),
            FreqDtype::F16 => inv_freq.iter_mut().for_each(|f| *f = half::f16::from_f32(*f).to_f32()),
        }
        Self { inv_freq }
    }

    /// cos and sin for each (position, pair): `[positions.len(), head_dim/2]` each.
    pub fn angles(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let n = positions.len() * self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &p in positions {
            for &f in &self.inv_freq {
                let a = f * p as f32;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Llama3Scaling;

    #[test]
    fn default_frequencies() {
        let t = RopeTable::new(&RopeConfig { theta: 10000.0, llama3: None, freq_factors: None, freq_dtype: FreqDtype::F32 }, 8);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in t.inv_freq.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn llama3_scaling_bands() {
        let s = Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64.0 };
        let plain = RopeTable::new(&RopeConfig { theta: 500000.0, llama3: None, freq_factors: None, freq_dtype: FreqDtype::F32 }, 16);
        let scaled = RopeTable::new(&RopeConfig { theta: 500000.0, llama3: Some(s), freq_factors: None, freq_dtype: FreqDtype::F32 }, 16);
        // highest frequency (wavelength 2π < 16) untouched; lowest divided by the factor
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 8.0).abs() < 1e-12);
    }
}

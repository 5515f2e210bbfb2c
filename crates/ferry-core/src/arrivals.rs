//! Arrival processes for replaying load: a seeded source of uniforms and Poisson arrivals. Pure;
//! the simulator ([`crate::sim`]), the autoscaler's policy ([`crate::autoscale`]) and the
//! benchmarks' load generator (`ferry`'s `loadgen`) draw from these.

/// A deterministic source of uniforms in [0, 1) (SplitMix64, Steele et al.): the same seed gives
/// the same workload.
pub fn uniforms(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Seconds after the start at which each of `n` requests is sent: exponential inter-arrival times
/// of mean `1 / rate` (a Poisson process), the first one after one such gap.
pub fn poisson_arrivals(rate: f64, n: usize, uniform: &mut dyn FnMut() -> f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += -(1.0 - uniform()).ln() / rate;
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_have_the_right_rate_and_reproduce() {
        let a = poisson_arrivals(4.0, 20_000, &mut uniforms(1));
        assert_eq!(a, poisson_arrivals(4.0, 20_000, &mut uniforms(1)));
        assert_ne!(a, poisson_arrivals(4.0, 20_000, &mut uniforms(2)));
        assert!(a.windows(2).all(|w| w[1] > w[0]));
        let rate = a.len() as f64 / a.last().unwrap();
        assert!((rate - 4.0).abs() < 0.1, "measured rate {rate}");
        // Exponential gaps: the coefficient of variation is 1.
        let gaps: Vec<f64> = std::iter::once(a[0]).chain(a.windows(2).map(|w| w[1] - w[0])).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((sd / mean - 1.0).abs() < 0.05, "cv {}", sd / mean);
    }
}

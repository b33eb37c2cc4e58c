//! Scalar CPU kernels, written so the compiler vectorises them: eight independent
//! accumulators break the dependency chain of a naive sum.

const LANES: usize = 8;

pub fn dot_f32(weights: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = weights.len() / LANES * LANES;
    for (w, v) in weights[..chunks]
        .chunks_exact(LANES)
        .zip(x[..chunks].chunks_exact(LANES))
    {
        for lane in 0..LANES {
            acc[lane] += w[lane] * v[lane];
        }
    }
    let mut sum = reduce(acc);
    for (w, v) in weights[chunks..].iter().zip(&x[chunks..]) {
        sum += w * v;
    }
    sum
}

pub fn dot_i8(weights: &[i8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = weights.len() / LANES * LANES;
    for (w, v) in weights[..chunks]
        .chunks_exact(LANES)
        .zip(x[..chunks].chunks_exact(LANES))
    {
        for lane in 0..LANES {
            acc[lane] += f32::from(w[lane]) * v[lane];
        }
    }
    let mut sum = reduce(acc);
    for (w, v) in weights[chunks..].iter().zip(&x[chunks..]) {
        sum += f32::from(*w) * v;
    }
    sum
}

fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Symmetric per-row int8: `scale = max|row| / 127`, values rounded half to even, as the
/// reference converters do (`np.rint`, `torch.round`).
pub fn quantize_int8_rows(values: &[f32], cols: usize) -> (Vec<i8>, Vec<f32>) {
    let rows = values.len() / cols.max(1);
    let mut quantised = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(rows);
    for row in values.chunks_exact(cols) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = (max / 127.0).max(1e-12);
        scales.push(scale);
        quantised.extend(
            row.iter()
                .map(|v| (v / scale).round_ties_even().clamp(-128.0, 127.0) as i8),
        );
    }
    (quantised, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_sum_on_odd_lengths() {
        let w: Vec<f32> = (0..19).map(|i| i as f32 * 0.5 - 3.0).collect();
        let x: Vec<f32> = (0..19).map(|i| (i % 5) as f32 - 2.0).collect();
        let naive: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert_eq!(dot_f32(&w, &x), naive);
    }

    #[test]
    fn int8_rows_round_half_to_even_and_reconstruct() {
        let row = [127.0f32, 0.5, 1.5, -2.5, -127.0];
        let (q, scales) = quantize_int8_rows(&row, 5);
        assert_eq!(scales, vec![1.0]);
        assert_eq!(q, vec![127, 0, 2, -2, -127]);
        let x = [1.0f32, 1.0, 1.0, 1.0, 1.0];
        assert_eq!(dot_i8(&q, &x) * scales[0], 0.0);
    }
}

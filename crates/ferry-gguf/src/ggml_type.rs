//! ggml tensor element types, with the numeric ids and block layouts of ggml's `enum ggml_type`
//! (ggml/include/ggml.h; block sizes from ggml-common.h / gguf-py's `GGML_QUANT_SIZES`).
//! Ids 4, 5 (Q4_2, Q4_3), 31–33 (Q4_0_4_4 …) and 36–38 were withdrawn upstream and read as `Other`.

/// A tensor's storage type. Quantized types store blocks of `block_elems` values in `block_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    /// An id this reader does not know; its byte size cannot be computed.
    Other(u32),
}

/// `(type, id, name, block_elems, block_bytes)` for every known type: the single source of truth.
const TABLE: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
    (GgmlType::NVFP4, 40, "NVFP4", 64, 36),
];

impl GgmlType {
    fn entry(&self) -> Option<&'static (GgmlType, u32, &'static str, u64, u64)> {
        TABLE.iter().find(|e| e.0 == *self)
    }

    /// The type with ggml id `id`; unknown ids become [`GgmlType::Other`].
    pub fn from_id(id: u32) -> Self {
        TABLE
            .iter()
            .find(|e| e.1 == id)
            .map_or(GgmlType::Other(id), |e| e.0)
    }

    /// ggml's numeric id for this type.
    pub fn id(&self) -> u32 {
        match self {
            GgmlType::Other(id) => *id,
            known => known.entry().map_or(u32::MAX, |e| e.1),
        }
    }

    /// Values per block (1 for plain types); `None` for [`GgmlType::Other`].
    pub fn block_elems(&self) -> Option<u64> {
        self.entry().map(|e| e.3)
    }

    /// Bytes per block; `None` for [`GgmlType::Other`].
    pub fn block_bytes(&self) -> Option<u64> {
        self.entry().map(|e| e.4)
    }

    /// ggml's name for the type (`"Q4_1"`), or `"type#<id>"` for unknown ids.
    pub fn name(&self) -> String {
        match self.entry() {
            Some(e) => e.2.to_string(),
            None => format!("type#{}", self.id()),
        }
    }

    /// Whether values are stored in quantized blocks (more than one value per block).
    pub fn is_quantized(&self) -> bool {
        self.block_elems().is_some_and(|n| n > 1)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for (i, e) in TABLE.iter().enumerate() {
            assert_eq!(GgmlType::from_id(e.1), e.0);
            assert_eq!(e.0.id(), e.1);
            assert!(TABLE[i + 1..].iter().all(|o| o.1 != e.1 && o.0 != e.0));
        }
        assert_eq!(GgmlType::from_id(4), GgmlType::Other(4));
        assert_eq!(GgmlType::Other(77).id(), 77);
        assert_eq!(GgmlType::Other(77).name(), "type#77");
        assert_eq!(GgmlType::Other(77).block_bytes(), None);
    }

    #[test]
    fn common_layouts() {
        let cases = [
            (GgmlType::F32, 1, 4),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::BF16, 1, 2),
        ];
        for (t, elems, bytes) in cases {
            assert_eq!(
                (t.block_elems(), t.block_bytes()),
                (Some(elems), Some(bytes)),
                "{t}"
            );
        }
    }
}

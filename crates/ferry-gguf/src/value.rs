//! Metadata values as stored in a GGUF key/value section, and the on-disk value type ids
//! (`enum gguf_type` in the GGUF spec: 0 = u8 … 12 = f64).

/// One metadata value. Arrays hold values of a single element type (possibly arrays themselves).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

/// The on-disk value type ids of the GGUF spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub(crate) fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type can occupy on disk (strings and arrays: their
    /// headers). Bounds element counts before anything is allocated.
    pub(crate) fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl MetaValue {
    /// A short description of the value's type, for error messages: `"u32"`, `"array of string"`.
    pub fn type_name(&self) -> String {
        match self {
            MetaValue::U8(_) => "u8".into(),
            MetaValue::I8(_) => "i8".into(),
            MetaValue::U16(_) => "u16".into(),
            MetaValue::I16(_) => "i16".into(),
            MetaValue::U32(_) => "u32".into(),
            MetaValue::I32(_) => "i32".into(),
            MetaValue::U64(_) => "u64".into(),
            MetaValue::I64(_) => "i64".into(),
            MetaValue::F32(_) => "f32".into(),
            MetaValue::F64(_) => "f64".into(),
            MetaValue::Bool(_) => "bool".into(),
            MetaValue::String(_) => "string".into(),
            MetaValue::Array(items) => match items.first() {
                Some(first) => format!("array of {}", first.type_name()),
                None => "empty array".into(),
            },
        }
    }

    /// The value as a signed 128-bit integer, if it is an integer of any width.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            MetaValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

//! `Secret`: a credential held as a string that never prints, so it cannot leak through a log
//! line or a `{:?}` of the config that holds it.

use std::fmt;

/// A string that never prints: upstream API keys and other credentials. Equality compares
/// the value itself, so a changed credential is noticed even though both print the same.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

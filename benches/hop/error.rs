//! The benchmark's one error type: any error, boxed; `main` returns it and the run ends.

use std::error::Error;

pub type BoxError = Box<dyn Error + Send + Sync>;
pub type Res<T> = Result<T, BoxError>;

//! What a request's record keeps of a stream resumed on another backend (issue 60): the parts
//! before the one that answered, why each ended, the tokens the client got from each, a
//! refusal's reason, and the prompt tokens the continuations prefilled (fleet spend beyond the
//! usage the client was told). Boxed in the record: most requests never resume.

use std::sync::Arc;

use fleetgate_protocol::resume::Cause;

#[derive(Debug, Default, Clone)]
pub(crate) struct ResumeLog {
    /// The parts that failed, in order; the answering part is the record's own backend.
    pub(crate) parts: Vec<ResumePart>,
    /// Why the stream was not resumed (it ended with its failure), if it was not.
    pub(crate) refused: Option<&'static str>,
    /// Prompt tokens the continuations prefilled: each holds the original prompt and the
    /// answer so far.
    pub(crate) continuation_prompt_tokens: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct ResumePart {
    pub(crate) backend: Arc<str>,
    pub(crate) cause: Cause,
    /// Token events the client received from this part.
    pub(crate) tokens: u32,
}

impl ResumeLog {
    /// Continuations sent.
    pub(crate) fn resumes(&self) -> usize {
        self.parts.len() - usize::from(self.refused.is_some())
    }

    /// The request log's `resume_detail`: the failed parts and a refusal, as JSON.
    pub(crate) fn detail(&self) -> String {
        let parts: Vec<serde_json::Value> = self
            .parts
            .iter()
            .map(|p| {
                serde_json::json!({
                    "backend": &*p.backend,
                    "cause": p.cause.as_str(),
                    "tokens": p.tokens,
                })
            })
            .collect();
        let mut detail = serde_json::json!({ "parts": parts });
        if let Some(r) = self.refused {
            detail["refused"] = r.into();
        }
        detail.to_string()
    }
}

//! Token counts as each wire protocol reports them. OpenAI's chat and completions say
//! `prompt_tokens`/`completion_tokens`; the Responses API and Anthropic's Messages API say
//! `input_tokens`/`output_tokens`. Both read into one `Usage`; a part that names only some of
//! the counts (Anthropic's `message_delta`) updates only those.

use serde::Deserialize;

/// Token counts reported by the backend in its usage event (or whole body).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// One `usage` object as sent: the counts it names, in either protocol's words.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct UsagePart {
    #[serde(default, alias = "input_tokens")]
    pub(crate) prompt_tokens: Option<u64>,
    #[serde(default, alias = "output_tokens")]
    pub(crate) completion_tokens: Option<u64>,
}

/// The most tokens one count of a request's usage can plausibly be: 2^24 (16 777 216), above
/// every model's context window and every output limit. A count past it is not a count (a
/// broken or hostile backend): settled, it would lock a key's token budget for years.
pub const MAX_PLAUSIBLE_TOKENS: u64 = 1 << 24;

impl Usage {
    /// Both counts within `MAX_PLAUSIBLE_TOKENS`.
    pub fn plausible(&self) -> bool {
        self.prompt_tokens <= MAX_PLAUSIBLE_TOKENS && self.completion_tokens <= MAX_PLAUSIBLE_TOKENS
    }
}

impl UsagePart {
    /// Every count it names within `MAX_PLAUSIBLE_TOKENS`.
    pub(crate) fn plausible(&self) -> bool {
        self.prompt_tokens.is_none_or(|t| t <= MAX_PLAUSIBLE_TOKENS)
            && self
                .completion_tokens
                .is_none_or(|t| t <= MAX_PLAUSIBLE_TOKENS)
    }

    /// Fold this part into what is known: the counts it names replace, the others stay.
    pub(crate) fn apply(self, to: &mut Option<Usage>) {
        let u = to.get_or_insert_with(Usage::default);
        if let Some(p) = self.prompt_tokens {
            u.prompt_tokens = p;
        }
        if let Some(c) = self.completion_tokens {
            u.completion_tokens = c;
        }
    }

    /// The part as a whole usage (what it does not name counts 0).
    pub(crate) fn whole(self) -> Usage {
        let mut u = None;
        self.apply(&mut u);
        u.unwrap_or_default()
    }
}

/// The last `"usage": {...}` object in `body`, else Cohere's `"billed_units"` (its
/// `/v2/embed` answer's `meta`, with `input_tokens`). An escaped `\"usage\"` inside a string
/// never matches: its quote is preceded by a backslash and followed by one.
pub(crate) fn usage_in(body: &[u8]) -> Option<UsagePart> {
    object_after(body, b"\"usage\"").or_else(|| object_after(body, b"\"billed_units\""))
}

fn object_after(body: &[u8], name: &[u8]) -> Option<UsagePart> {
    let at = memchr::memmem::rfind(body, name)?;
    let rest = body[at + name.len()..]
        .trim_ascii_start()
        .strip_prefix(b":")?;
    serde_json::Deserializer::from_slice(rest)
        .into_iter::<UsagePart>()
        .next()?
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_either_protocols_words() {
        let chat = br#"{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5}}"#;
        assert_eq!(
            usage_in(chat).map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 5
            })
        );
        let responses = br#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":13},"user":null}}"#;
        assert_eq!(
            usage_in(responses).map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 4
            })
        );
        // Anthropic: message_start gives both, message_delta the cumulative output only.
        let mut u = None;
        usage_in(
            br#"{"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":0}}}"#,
        )
        .unwrap()
        .apply(&mut u);
        usage_in(br#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#)
            .unwrap()
            .apply(&mut u);
        usage_in(br#"{"type":"message_delta","delta":{},"usage":{"output_tokens":8}}"#)
            .unwrap()
            .apply(&mut u);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 8
            })
        );
        assert_eq!(usage_in(br#"{"usage":null}"#), None);
        // Cohere's /v2/embed bills its input in `meta`.
        let cohere = br#"{"id":"embd-1","embeddings":{"float":[[0.1]]},"texts":null,"meta":{"api_version":{"version":"2"},"billed_units":{"input_tokens":6,"image_tokens":null}},"response_type":"embeddings_by_type"}"#;
        assert_eq!(
            usage_in(cohere).map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 6,
                completion_tokens: 0
            })
        );
        assert_eq!(usage_in(br#"{"text":"a \"usage\": {} b"}"#), None);
    }
}

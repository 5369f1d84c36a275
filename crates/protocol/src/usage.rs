//! Token counts as each wire protocol reports them. OpenAI's chat and completions say
//! `prompt_tokens`/`completion_tokens`; the Responses API and Anthropic's Messages API say
//! `input_tokens`/`output_tokens`. Both read into one `Usage`; a part that names only some of
//! the counts (Anthropic's `message_delta`) updates only those.
//!
//! The prompt tokens the engine served from its prefix cache are read too, where the backend
//! says: `prompt_tokens_details.cached_tokens` (chat and completions, vLLM with
//! `--enable-prompt-tokens-details`), `input_tokens_details.cached_tokens` (Responses), and
//! `cache_read_input_tokens` (Messages).

use serde::Deserialize;

/// Token counts reported by the backend in its usage event (or whole body).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens the engine read from its prefix cache, when it said (at most
    /// `MAX_PLAUSIBLE_TOKENS`, so 32 bits: the usage stays 24 bytes in every request's record).
    pub cached_tokens: Option<u32>,
}

/// One `usage` object as sent: the counts it names, in either protocol's words.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct UsagePart {
    #[serde(default, alias = "input_tokens")]
    pub(crate) prompt_tokens: Option<u64>,
    #[serde(default, alias = "output_tokens")]
    pub(crate) completion_tokens: Option<u64>,
    /// `{"cached_tokens": K, ...}`; any other shape is ignored (the counts still count).
    #[serde(default, alias = "input_tokens_details")]
    pub(crate) prompt_tokens_details: Option<Details>,
    /// Anthropic's words for the cached prompt tokens. Its `input_tokens` are the prompt
    /// tokens neither read from nor written to the cache (vLLM's `/v1/messages` too:
    /// `input_tokens = prompt_tokens - cache_read - cache_creation`), so the prompt is the sum.
    #[serde(default, deserialize_with = "lenient_count")]
    pub(crate) cache_read_input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient_count")]
    pub(crate) cache_creation_input_tokens: Option<u64>,
}

/// The part of `prompt_tokens_details` read: the cached count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Details {
    pub(crate) cached_tokens: Option<u64>,
}

impl<'de> Deserialize<'de> for Details {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Shape {
            #[serde(default, deserialize_with = "lenient_count")]
            cached_tokens: Option<u64>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Lenient {
            Shape(Shape),
            Other(serde::de::IgnoredAny),
        }
        Ok(match Lenient::deserialize(d)? {
            Lenient::Shape(s) => Details {
                cached_tokens: s.cached_tokens,
            },
            Lenient::Other(_) => Details::default(),
        })
    }
}

/// A count, or nothing for `null` and for anything that is not a count.
fn lenient_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Lenient {
        Count(u64),
        Other(serde::de::IgnoredAny),
    }
    Ok(match Lenient::deserialize(d)? {
        Lenient::Count(n) => Some(n),
        Lenient::Other(_) => None,
    })
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
    /// The prompt tokens this part names, if it names them.
    pub fn prompt(&self) -> Option<u64> {
        self.prompt_tokens
    }

    /// Every count it names within `MAX_PLAUSIBLE_TOKENS`.
    pub(crate) fn plausible(&self) -> bool {
        self.prompt_tokens.is_none_or(|t| t <= MAX_PLAUSIBLE_TOKENS)
            && self
                .completion_tokens
                .is_none_or(|t| t <= MAX_PLAUSIBLE_TOKENS)
    }

    /// The cached prompt tokens it names, in whichever words.
    pub(crate) fn cached(&self) -> Option<u64> {
        self.prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .or(self.cache_read_input_tokens)
    }

    /// Fold this part into what is known: the counts it names replace, the others stay.
    pub(crate) fn apply(self, to: &mut Option<Usage>) {
        let u = to.get_or_insert_with(Usage::default);
        if let Some(p) = self.prompt_tokens {
            // Anthropic's prompt is in three parts (each within the plausible bound, so the
            // sum cannot overflow).
            let part = |n: Option<u64>| n.filter(|n| *n <= MAX_PLAUSIBLE_TOKENS).unwrap_or(0);
            u.prompt_tokens = p
                .saturating_add(part(self.cache_read_input_tokens))
                .saturating_add(part(self.cache_creation_input_tokens));
        }
        if let Some(c) = self.completion_tokens {
            u.completion_tokens = c;
        }
        // A cache count past every plausible count is no count (the others still are).
        if let Some(c) = self
            .cached()
            .filter(|c| *c <= MAX_PLAUSIBLE_TOKENS)
            .and_then(|c| u32::try_from(c).ok())
        {
            u.cached_tokens = Some(c);
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
                completion_tokens: 5,
                cached_tokens: None
            })
        );
        let responses = br#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":13},"user":null}}"#;
        assert_eq!(
            usage_in(responses).map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 4,
                cached_tokens: Some(0)
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
                completion_tokens: 8,
                cached_tokens: None
            })
        );
        assert_eq!(usage_in(br#"{"usage":null}"#), None);
        // Cohere's /v2/embed bills its input in `meta`.
        let cohere = br#"{"id":"embd-1","embeddings":{"float":[[0.1]]},"texts":null,"meta":{"api_version":{"version":"2"},"billed_units":{"input_tokens":6,"image_tokens":null}},"response_type":"embeddings_by_type"}"#;
        assert_eq!(
            usage_in(cohere).map(UsagePart::whole),
            Some(Usage {
                prompt_tokens: 6,
                completion_tokens: 0,
                cached_tokens: None
            })
        );
        assert_eq!(usage_in(br#"{"text":"a \"usage\": {} b"}"#), None);
    }

    #[test]
    fn reads_the_cached_prompt_tokens_in_each_protocols_words() {
        let cached = |body: &[u8]| {
            usage_in(body)
                .map(UsagePart::whole)
                .and_then(|u| u.cached_tokens)
        };
        assert_eq!(
            cached(br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#),
            Some(32)
        );
        assert_eq!(
            cached(br#"{"response":{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":16},"output_tokens":1}}}"#),
            Some(16)
        );
        assert_eq!(
            cached(br#"{"message":{"usage":{"input_tokens":8,"cache_read_input_tokens":48,"output_tokens":0}}}"#),
            Some(48)
        );
        // Anthropic's (and vLLM's /v1/messages') input_tokens leave out what the cache read
        // and wrote: the prompt is all three.
        let messages = usage_in(br#"{"message":{"usage":{"input_tokens":8,"cache_creation_input_tokens":4,"cache_read_input_tokens":48,"output_tokens":0}}}"#)
            .map(UsagePart::whole)
            .unwrap();
        assert_eq!(
            (messages.prompt_tokens, messages.cached_tokens),
            (60, Some(48))
        );
        // Not said, said as null, or said in a shape that is not a count: no count, and the
        // other counts still read.
        for body in [
            &br#"{"usage":{"prompt_tokens":40,"completion_tokens":2}}"#[..],
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":null}}"#,
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":null}}}"#,
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":"many"}}"#,
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":-3}}}"#,
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"cache_read_input_tokens":"x"}}"#,
            br#"{"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":99999999999}}}"#,
        ] {
            let u = usage_in(body).map(UsagePart::whole).unwrap();
            assert_eq!((u.prompt_tokens, u.completion_tokens, u.cached_tokens), (40, 2, None), "{}", String::from_utf8_lossy(body));
        }
        // A later part that does not name the cache keeps the count an earlier one gave.
        let mut u = None;
        usage_in(br#"{"message":{"usage":{"input_tokens":8,"cache_read_input_tokens":48}}}"#)
            .unwrap()
            .apply(&mut u);
        usage_in(br#"{"usage":{"output_tokens":3}}"#)
            .unwrap()
            .apply(&mut u);
        assert_eq!(u.unwrap().cached_tokens, Some(48));
    }
}

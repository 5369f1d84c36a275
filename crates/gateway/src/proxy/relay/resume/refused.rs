//! Why a stream that failed mid-answer was not continued on another backend: the reason its
//! error event names and the refusal metric counts, and the words a client reads.

use fleetgate_protocol::resume::NotResumable;

/// Why a failed stream was not continued: the error event's reason and the metric's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::proxy::relay) enum Refused {
    Shape(NotResumable),
    /// The failure came inside an event whose start the client already has.
    PartialEvent,
    /// The request's `max_resumes` are spent.
    MaxResumes,
    /// No other backend of the pool may take it (down, ejected, draining, or none).
    NoBackend,
    /// The queue refused the continuation or its wait ran out.
    Queue,
    /// The request's total limit has passed.
    Deadline,
    /// The continuation request failed (unreachable, an error answer, not a stream).
    ContinuationFailed,
    /// Every token the request allowed was sent, but not the answer's end.
    LimitReached,
}

impl Refused {
    pub(in crate::proxy::relay) fn as_str(self) -> &'static str {
        match self {
            Refused::Shape(n) => n.as_str(),
            Refused::PartialEvent => "partial_event",
            Refused::MaxResumes => "max_resumes",
            Refused::NoBackend => "no_backend",
            Refused::Queue => "queue",
            Refused::Deadline => "deadline",
            Refused::ContinuationFailed => "continuation_failed",
            Refused::LimitReached => "limit_reached",
        }
    }

    pub(super) fn why(self) -> &'static str {
        match self {
            Refused::Shape(NotResumable::Endpoint) => {
                "vLLM continues no answer on this endpoint (only chat completions and completions)"
            }
            Refused::Shape(NotResumable::SeveralChoices) => {
                "the request asked for several choices (n or best_of above 1)"
            }
            Refused::Shape(NotResumable::Logprobs) => {
                "the request asked for log probabilities, which a continuation would give of another prompt"
            }
            Refused::Shape(NotResumable::GuidedDecoding) => {
                "the request uses guided decoding or a required tool, whose grammar state cannot be handed over"
            }
            Refused::Shape(NotResumable::PromptNotText) => {
                "the prompt is not one text (token ids, several prompts, or echo)"
            }
            Refused::Shape(NotResumable::ToolCall) => {
                "a tool call was being streamed: its arguments are a parser's split of the raw text"
            }
            Refused::Shape(NotResumable::Reasoning) => {
                "reasoning text was streamed: a reasoning parser's split of the raw text cannot be rebuilt"
            }
            Refused::Shape(NotResumable::StopAtSeam) => {
                "the answer so far ends with the start of a stop sequence, which the engine would not see across the seam"
            }
            Refused::Shape(NotResumable::Body) => "the request body is not a JSON object",
            Refused::PartialEvent => "the failure came in the middle of an event",
            Refused::MaxResumes => "the stream was already resumed max_resumes times",
            Refused::NoBackend => "no other backend of the pool can take it",
            Refused::Queue => "the pool's queue refused the continuation or its wait ran out",
            Refused::Deadline => "the request's total time limit has passed",
            Refused::ContinuationFailed => "the continuation request failed too",
            Refused::LimitReached => "every token the request allowed was already sent",
        }
    }
}

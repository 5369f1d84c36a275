//! A prompt's size, counted while the body is parsed, without building a tree.
//!
//! Every prompt-bearing field is a nesting of strings, token ids, lists and objects, and each
//! protocol nests them its own way: chat `messages` hold messages whose `content` is a string
//! or a list of parts, a completions `prompt` is a string or token ids or a list of either, a
//! Responses `input` holds items, pooling text takes nearly anything. One counter reads them
//! all (`Count`); what each level may hold is a `Shape`, and the shapes below are the
//! protocols' grammars. A value of another type is refused with the shape's `EXPECTING`, which
//! the client sees in the 400.
//!
//! Characters are counted, as a cheap estimate of size; a token id counts as 4.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected};

/// How a level is read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Read {
    /// Whatever the value is; the shape's flags say which types count.
    Any,
    /// Only a list.
    List,
    /// Only an object.
    Object,
}

/// What one level of a prompt-bearing field may hold, and how each part of it counts.
pub(super) trait Shape {
    /// What the value should be, said in the refusal of any other.
    const EXPECTING: &'static str;
    const READ: Read = Read::Any;
    /// A string counts its characters.
    const STRING: bool = false;
    /// A token id (a non-negative integer) counts 4.
    const TOKEN_ID: bool = false;
    /// `null` counts 0.
    const NULL: bool = false;
    /// Any other scalar is accepted: other numbers count 4, `true` and `false` 0 (pooling
    /// input, whose shapes are the backend's to check).
    const ANY_SCALAR: bool = false;
    /// A list counts its elements, each read as `Element` (any `Read::Any` or `Read::List`
    /// shape takes lists).
    type Element: Shape;
    /// An object counts the values of these keys, each read as `Field`, and skips the others.
    /// Empty: objects are refused.
    const FIELDS: &'static [&'static str] = &[];
    type Field: Shape;
}

/// A field's size: its characters, and how many prompts a list of them holds.
pub(super) struct Count<S> {
    pub(crate) chars: usize,
    /// A list: its elements that are not bare token ids (each a prompt or a conversation of
    /// its own); a single value: 1, or 0 for a token id.
    pub(crate) prompts: u32,
    token_id: bool,
    shape: PhantomData<S>,
}

// By hand: a derive would ask the shape (a marker) to be `Copy` too.
impl<S> Clone for Count<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Count<S> {}

impl<S> Count<S> {
    fn of(chars: usize) -> Self {
        Count {
            chars,
            prompts: 1,
            token_id: false,
            shape: PhantomData,
        }
    }
}

impl<'de, S: Shape> Deserialize<'de> for Count<S> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let visitor = Counter::<S>(PhantomData);
        match S::READ {
            Read::Any => d.deserialize_any(visitor),
            Read::List => d.deserialize_seq(visitor),
            Read::Object => d.deserialize_map(visitor),
        }
    }
}

struct Counter<S>(PhantomData<S>);

impl<'de, S: Shape> de::Visitor<'de> for Counter<S> {
    type Value = Count<S>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(S::EXPECTING)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Count<S>, E> {
        if S::STRING {
            Ok(Count::of(s.chars().count()))
        } else {
            Err(E::invalid_type(Unexpected::Str(s), &self))
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count<S>, E> {
        if S::TOKEN_ID || S::ANY_SCALAR {
            Ok(Count {
                prompts: 0,
                token_id: true,
                ..Count::of(4)
            })
        } else {
            Err(E::invalid_type(Unexpected::Unsigned(v), &self))
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count<S>, E> {
        if S::ANY_SCALAR {
            Ok(Count::of(4))
        } else {
            Err(E::invalid_type(Unexpected::Signed(v), &self))
        }
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Count<S>, E> {
        if S::ANY_SCALAR {
            Ok(Count::of(4))
        } else {
            Err(E::invalid_type(Unexpected::Float(v), &self))
        }
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Count<S>, E> {
        if S::ANY_SCALAR {
            Ok(Count::of(0))
        } else {
            Err(E::invalid_type(Unexpected::Bool(v), &self))
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Count<S>, E> {
        if S::NULL || S::ANY_SCALAR {
            Ok(Count::of(0))
        } else {
            Err(E::invalid_type(Unexpected::Unit, &self))
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count<S>, A::Error> {
        if S::READ == Read::Object {
            return Err(de::Error::invalid_type(Unexpected::Seq, &self));
        }
        let (mut chars, mut prompts) = (0usize, 0u32);
        while let Some(e) = seq.next_element::<Count<S::Element>>()? {
            chars += e.chars;
            prompts = prompts.saturating_add(u32::from(!e.token_id));
        }
        Ok(Count {
            chars,
            prompts,
            token_id: false,
            shape: PhantomData,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Count<S>, A::Error> {
        if S::FIELDS.is_empty() {
            return Err(de::Error::invalid_type(Unexpected::Map, &self));
        }
        let mut chars = 0;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if S::FIELDS.contains(&&*key) {
                chars += map.next_value::<Count<S::Field>>()?.chars;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(Count::of(chars))
    }
}

// ---- the protocols' grammars ------------------------------------------------------------

/// The keys of a message whose values are its text (`output` and `arguments`: a Responses
/// function call's result and call).
const MESSAGE_TEXT: &[&str] = &["content", "output", "arguments"];

/// A list of chat messages (chat, Messages, the tokenizer's `messages`).
pub(super) struct Messages;
impl Shape for Messages {
    const EXPECTING: &'static str = "an array of messages";
    const READ: Read = Read::List;
    type Element = Message;
    type Field = Message;
}

/// A chat message: its content is its text.
pub(super) struct Message;
impl Shape for Message {
    const EXPECTING: &'static str = "a message object with `role` and `content`";
    const READ: Read = Read::Object;
    type Element = Message;
    const FIELDS: &'static [&'static str] = MESSAGE_TEXT;
    type Field = Content;
}

/// A message's content (also the Responses `instructions` and Anthropic's `system`): a
/// string, a list of parts, or null.
pub(super) struct Content;
impl Shape for Content {
    const EXPECTING: &'static str = "a string or an array of content parts";
    const STRING: bool = true;
    const NULL: bool = true;
    type Element = Part;
    type Field = Content;
}

/// A content part (`{"type":"text","text":...}`); `content`: an Anthropic `tool_result`
/// block's own blocks or text.
pub(super) struct Part;
impl Shape for Part {
    const EXPECTING: &'static str =
        "a content part object such as {\"type\":\"text\",\"text\":\"...\"}";
    const READ: Read = Read::Object;
    type Element = Part;
    const FIELDS: &'static [&'static str] = &["text", "content"];
    type Field = Content;
}

/// A prompt: a string, token ids, or a list of them.
pub(super) struct Prompt;
impl Shape for Prompt {
    const EXPECTING: &'static str = "a string, an array of strings, or an array of token ids";
    const STRING: bool = true;
    const TOKEN_ID: bool = true;
    type Element = Prompt;
    type Field = Prompt;
}

/// A completions `prompt`: one prompt, or a list of prompts that vLLM answers each of (token
/// ids alone are one prompt; each string or list of ids in the list is one).
pub(super) struct CompletionPrompts;
impl Shape for CompletionPrompts {
    const EXPECTING: &'static str = "a string, an array of strings, or an array of token ids";
    const STRING: bool = true;
    type Element = Prompt;
    type Field = Prompt;
}

/// A Responses or pooling `input`: a string, or a list of input items.
pub(super) struct Input;
impl Shape for Input {
    const EXPECTING: &'static str = "a string or a list of input items";
    const STRING: bool = true;
    type Element = Item;
    type Field = Item;
}

/// An element of an `input` list: an item or message (its text counted), a string, a token
/// id, or a list of token ids.
pub(super) struct Item;
impl Shape for Item {
    const EXPECTING: &'static str = "an input item, a string, or token ids";
    const STRING: bool = true;
    const TOKEN_ID: bool = true;
    type Element = Prompt;
    const FIELDS: &'static [&'static str] = MESSAGE_TEXT;
    type Field = Content;
}

/// Pooling text of any shape: strings, numbers, lists of them, and objects' `text` and
/// `content` (multimodal parts: their other fields, such as image URLs, are not text).
pub(super) struct Text;
impl Shape for Text {
    const EXPECTING: &'static str = "a string, a list of strings, token ids, or content parts";
    const STRING: bool = true;
    const TOKEN_ID: bool = true;
    const ANY_SCALAR: bool = true;
    type Element = Text;
    const FIELDS: &'static [&'static str] = &["text", "content"];
    type Field = Text;
}

/// A batch's conversations: each a list of messages; `prompts` is how many.
pub(super) struct Conversations;
impl Shape for Conversations {
    const EXPECTING: &'static str = "a list of conversations, each an array of messages";
    const READ: Read = Read::List;
    type Element = Messages;
    type Field = Messages;
}

//! A request's prompt as the engine's own tokens, so the gateway can cut it into the engine's
//! KV blocks: a chat request rendered as vLLM renders it — the model's chat template (from
//! `tokenizer_config.json`, `chat_template.jinja`, or a file) with Hugging Face's Jinja
//! settings (`trim_blocks`, `lstrip_blocks`, loop controls, Python's string methods, a `tojson`
//! that writes as Python's `json.dumps`) over vLLM's view of the messages — then tokenized
//! without special tokens added (the template holds them); a completions prompt tokenized as is,
//! with them.
//!
//! vLLM's view of a chat request (0.32, for a template that takes string contents): each
//! message is `{role, content}` with text parts joined by newlines and no content as `""`, plus
//! `tool_calls` (arguments parsed from their JSON string into an ordered map), `tool_call_id`,
//! `name` and `reasoning_content` where the request has them; `tools` as vLLM dumps its tool
//! model (`{"type", "function": {"name", "description", "parameters"}}`); the special tokens of
//! `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`); and the
//! request's `add_generation_prompt` (default true), `continue_final_message` and
//! `chat_template_kwargs`.

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Deserialize;

/// The model's tokenizer and chat template, loaded once per pool.
pub struct PromptTokens {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    has_template: bool,
    /// `bos_token` and the like, as the template sees them.
    special: Vec<(String, String)>,
    /// The ids of the stretches between added tokens seen before (a chat's history), when the
    /// tokenizer's added tokens allow encoding stretch by stretch.
    segments: Option<super::segments::Segments>,
}

/// Ids of stretches remembered per generation (`segments`): 4 MiB each, 8 MiB at most.
const SEGMENT_IDS: usize = 1 << 20;

impl std::fmt::Debug for PromptTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokens")
            .field("has_template", &self.has_template)
            .finish_non_exhaustive()
    }
}

/// A special token in `tokenizer_config.json`: a string, or `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl PromptTokens {
    /// Loads `dir/tokenizer.json` and the chat template: `template` when given, else
    /// `tokenizer_config.json`'s `chat_template` (its `default` when it is a list), else
    /// `dir/chat_template.jinja`. Without any, chat requests cannot be cut (completions can).
    pub fn load(dir: &Path, template: Option<&Path>) -> Result<PromptTokens, String> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| format!("{}: {e}", tok_path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", cfg_path.display()))?
            }
            Err(_) => serde_json::Value::Null,
        };
        let special = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .into_iter()
            .filter_map(|k| Some((k.to_owned(), token_text(cfg.get(k)?)?)))
            .collect();
        let from_config = match cfg.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => None,
        };
        let read =
            |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
        let source = match (template, from_config) {
            (Some(p), _) => Some(read(p)?),
            (None, Some(t)) => Some(t),
            (None, None) => {
                let p = dir.join("chat_template.jinja");
                p.exists().then(|| read(&p)).transpose()?
            }
        };
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        let has_template = source.is_some();
        if let Some(src) = source {
            env.add_template_owned("chat", src)
                .map_err(|e| format!("the chat template does not parse: {e}"))?;
        }
        let segments = super::segments::Segments::new(&tokenizer, SEGMENT_IDS);
        Ok(PromptTokens {
            tokenizer,
            env,
            has_template,
            special,
            segments,
        })
    }

    /// The chat request's prompt as the template renders it.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, String> {
        if !self.has_template {
            return Err("the model has no chat template".into());
        }
        let req: ChatBody =
            serde_json::from_slice(body).map_err(|e| format!("not a chat request: {e}"))?;
        let last_text = req.messages.last().map(Message::text).unwrap_or_default();
        let messages: Vec<Value> = req
            .messages
            .into_iter()
            .map(Message::into_value)
            .collect::<Result<_, _>>()?;
        let tools = req
            .tools
            .map(|t| Value::from(t.into_iter().map(Tool::into_value).collect::<Vec<_>>()));
        let mut ctx: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        if let Some(kwargs) = req.chat_template_kwargs.filter(|k| !k.is_none()) {
            let keys = kwargs
                .try_iter()
                .map_err(|_| "chat_template_kwargs is not an object".to_owned())?;
            for k in keys {
                let v = kwargs.get_item(&k).map_err(|e| e.to_string())?;
                ctx.push((k.to_string(), v));
            }
        }
        ctx.push(("messages".into(), Value::from(messages)));
        ctx.push(("tools".into(), tools.unwrap_or(Value::from(()))));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(req.add_generation_prompt.unwrap_or(true)),
        ));
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut text = tmpl
            .render(Value::from_pairs(ctx))
            .map_err(|e| format!("the chat template failed: {e}"))?;
        if req.continue_final_message == Some(true) {
            // As Hugging Face does for vLLM: the prompt ends right after the last occurrence
            // of the final message's text (stripped), so the answer continues it.
            let last = last_text.trim();
            let at = text
                .rfind(last)
                .ok_or("continue_final_message: the final message's text is not in the prompt")?;
            text.truncate(at + last.len());
        }
        Ok(text)
    }

    /// The chat request's prompt as the engine's token ids.
    pub fn chat(&self, body: &[u8]) -> Result<Vec<u32>, String> {
        let text = self.render_chat(body)?;
        match &self.segments {
            // The history's stretches as encoded before, only the new ones encoded now.
            Some(s) => s.encode(&text, |t| self.encode(t, false)),
            None => self.encode(&text, false),
        }
    }

    /// The chat prompt's ids encoded whole, without the remembered stretches.
    #[cfg(test)]
    pub(crate) fn chat_whole(&self, body: &[u8]) -> Result<Vec<u32>, String> {
        self.encode(&self.render_chat(body)?, false)
    }

    /// A completions prompt's token ids (special tokens added as the tokenizer adds them).
    pub fn completion(&self, prompt: &str) -> Result<Vec<u32>, String> {
        self.encode(prompt, true)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("the tokenizer failed: {e}"))
    }
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    tools: Option<Vec<Tool>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    /// A JSON object: each key becomes a template variable.
    chat_template_kwargs: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
    name: Option<String>,
    tool_calls: Option<Vec<ToolCall>>,
    tool_call_id: Option<String>,
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct ToolCall {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    function: FunctionCall,
}

#[derive(Deserialize)]
struct FunctionCall {
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: Option<String>,
    function: FunctionDef,
}

#[derive(Deserialize)]
struct FunctionDef {
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::from_pairs(pairs)
}

impl Message {
    /// The text of its last part (all of it when it is a string), as Hugging Face looks for it.
    fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => parts
                .last()
                .and_then(|p| p.text.clone())
                .unwrap_or_default(),
        }
    }

    fn into_value(self) -> Result<Value, String> {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                    return Err(format!("a `{}` content part is not text", p.kind));
                }
                parts
                    .into_iter()
                    .filter_map(|p| p.text)
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        let mut m = vec![
            ("role", Value::from(self.role)),
            ("content", Value::from(content)),
        ];
        if let Some(name) = self.name {
            m.push(("name", Value::from(name)));
        }
        if let Some(calls) = self.tool_calls {
            let calls = calls
                .into_iter()
                .map(|c| {
                    let args: Value = serde_json::from_str(&c.function.arguments)
                        .unwrap_or_else(|_| Value::from(c.function.arguments.as_str()));
                    let mut call = Vec::new();
                    if let Some(id) = c.id {
                        call.push(("id", Value::from(id)));
                    }
                    call.push((
                        "type",
                        Value::from(c.kind.unwrap_or_else(|| "function".into())),
                    ));
                    call.push((
                        "function",
                        map(vec![
                            ("name", Value::from(c.function.name)),
                            ("arguments", args),
                        ]),
                    ));
                    map(call)
                })
                .collect::<Vec<_>>();
            m.push(("tool_calls", Value::from(calls)));
        }
        if let Some(id) = self.tool_call_id {
            m.push(("tool_call_id", Value::from(id)));
        }
        if let Some(r) = self.reasoning_content {
            m.push(("reasoning_content", Value::from(r)));
        }
        Ok(map(m))
    }
}

impl Tool {
    fn into_value(self) -> Value {
        let f = self.function;
        map(vec![
            (
                "type",
                Value::from(self.kind.unwrap_or_else(|| "function".into())),
            ),
            (
                "function",
                map(vec![
                    ("name", Value::from(f.name)),
                    (
                        "description",
                        f.description.map_or(Value::from(()), Value::from),
                    ),
                    ("parameters", f.parameters.unwrap_or(Value::from(()))),
                ]),
            ),
        ])
    }
}

/// Hugging Face's `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=indent)`,
/// keys in their order, `", "` and `": "` between items (`","` before a newline when indented).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "a number tojson cannot write")
                })?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_str(out, &k.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "a value tojson cannot write",
            ));
        }
    }
    Ok(())
}

/// Python's `repr` of a float, as `json.dumps` writes it.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let s = format!("{f:?}");
    // Rust writes 1e-5 as 1e-5, Python as 1e-05; and 1e20 as 1e20, Python as 1e+20.
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
#[path = "prompt/tests.rs"]
mod tests;

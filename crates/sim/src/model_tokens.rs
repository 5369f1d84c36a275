//! `--tokenizer DIR`: prompts cut into the model's own tokens, so that the prefix cache's
//! blocks, the prompt counts in usage and the KV events the sim publishes are what vLLM would
//! make of the same request with the same model files.
//!
//! Chat prompts are rendered with the model's chat template as vLLM renders them for a plain
//! request (the request's `messages` and `tools` as sent, `add_generation_prompt` unless the
//! request turns it off, `chat_template_kwargs` as variables) and tokenized without special
//! tokens (the template writes them); completions prompts are tokenized with them, as vLLM's
//! completions endpoint does. Without `--tokenizer` the sim keeps its own word pieces.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// The model's tokenizer and chat template.
pub(crate) struct ModelTokens {
    tokenizer: tokenizers::Tokenizer,
    /// The template, compiled as "chat"; `None`: the model has none, so chat is refused.
    env: Option<Environment<'static>>,
    /// `bos_token`, `eos_token` as `tokenizer_config.json` names them (templates use both).
    specials: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for ModelTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokens")
            .field("chat_template", &self.env.is_some())
            .finish_non_exhaustive()
    }
}

impl ModelTokens {
    /// `dir/tokenizer.json`, and the chat template: `template` if given, else
    /// `tokenizer_config.json`'s `chat_template` (the one named `default` in a list), else
    /// `dir/chat_template.jinja`.
    pub(crate) fn load(dir: &Path, template: Option<&Path>) -> Result<Self, String> {
        let file = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| format!("--tokenizer: {}: {e}", file.display()))?;
        let config_file = dir.join("tokenizer_config.json");
        let config: Json = if config_file.exists() {
            let text = std::fs::read_to_string(&config_file)
                .map_err(|e| format!("--tokenizer: {}: {e}", config_file.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("--tokenizer: {}: {e}", config_file.display()))?
        } else {
            Json::Null
        };
        let specials = ["bos_token", "eos_token"]
            .into_iter()
            .filter_map(|name| {
                let text = match config.get(name)? {
                    Json::String(s) => s.clone(),
                    Json::Object(o) => o.get("content")?.as_str()?.to_owned(),
                    _ => return None,
                };
                Some((name, text))
            })
            .collect();
        let source = if let Some(path) = template {
            Some(read(path)?)
        } else if let Some(t) = config_template(&config) {
            Some(t)
        } else {
            let path = dir.join("chat_template.jinja");
            if path.exists() {
                Some(read(&path)?)
            } else {
                None
            }
        };
        let env = source.map(environment).transpose()?;
        Ok(Self {
            tokenizer,
            env,
            specials,
        })
    }

    /// A chat request's prompt tokens: its template rendered, then tokenized.
    pub(crate) fn chat(&self, body: &[u8]) -> Result<Vec<u32>, String> {
        let env = self.env.as_ref().ok_or(
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.",
        )?;
        let mut request: Json = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        // Text parts are joined with newlines, as vLLM hands them to a string template.
        if let Some(messages) = request["messages"].as_array_mut() {
            for m in messages {
                if let Some(parts) = m["content"].as_array() {
                    let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
                    m["content"] = Json::from(text.join("\n"));
                }
            }
        }
        let mut vars: std::collections::BTreeMap<String, Value> = self
            .specials
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(v.as_str())))
            .collect();
        vars.insert("messages".into(), jinja(&request["messages"]));
        if request.get("tools").is_some_and(|t| !t.is_null()) {
            // Read again in the order sent: a tool's schema is written as the client wrote it.
            let ordered: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
            let tools = ordered.get_attr("tools").map_err(|e| e.to_string())?;
            vars.insert("tools".into(), tools);
        }
        let continue_final = request["continue_final_message"].as_bool() == Some(true);
        let generation = request["add_generation_prompt"]
            .as_bool()
            .unwrap_or(!continue_final);
        vars.insert("add_generation_prompt".into(), Value::from(generation));
        if let Some(Json::Object(kwargs)) = request.get("chat_template_kwargs") {
            for (k, v) in kwargs {
                vars.insert(k.clone(), jinja(v));
            }
        }
        let text = env
            .get_template("chat")
            .and_then(|t| t.render(Value::from(vars)))
            .map_err(|e| format!("the chat template cannot render this request: {e}"))?;
        self.encode(&text, false)
    }

    /// A completions prompt's tokens (special tokens added, as vLLM does).
    pub(crate) fn completion(&self, prompt: &str) -> Result<Vec<u32>, String> {
        self.encode(prompt, true)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }
}

/// A JSON value as the template sees it.
fn jinja(v: &Json) -> Value {
    serde::Deserialize::deserialize(v).unwrap_or_default()
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("--chat-template: {}: {e}", path.display()))
}

/// `chat_template` of `tokenizer_config.json`: a string, or a list of named templates.
fn config_template(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(t) => Some(t.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))?
            .get("template")?
            .as_str()
            .map(str::to_owned),
        _ => None,
    }
}

/// An environment as Hugging Face's renders templates: blocks trimmed, Python's string and
/// dict methods, `raise_exception`, and `tojson` written as Python's `json.dumps`.
fn environment(source: String) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| e.to_string())?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_filter("tojson", python_json);
    env.add_template_owned("chat", source)
        .map_err(|e| format!("--chat-template: the chat template does not parse: {e}"))?;
    Ok(env)
}

/// `json.dumps(value, ensure_ascii=False)`: `", "` between items and `": "` after keys.
fn python_json(value: Value) -> Result<String, Error> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonSeparators);
    serde::Serialize::serialize(&value, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(out).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

struct PythonSeparators;

impl serde_json::ser::Formatter for PythonSeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

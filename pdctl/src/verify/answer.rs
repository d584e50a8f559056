//! The HTTP side of `pdctl verify`: requests to the router and the parts of an answer that
//! must be identical between runs (text, reasoning, tool calls, every token's logprob).

use std::net::SocketAddr;

use serde_json::Value;

use super::{REQUEST_TIMEOUT, error::VerifyError};

/// A router and the model it serves.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    addr: SocketAddr,
    bearer: Option<String>,
    model: String,
}

/// What an answer is compared on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<Value>,
    /// (token text, logprob) of every generated token.
    pub logprobs: Vec<(String, f64)>,
    pub finish: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Answer {
    pub fn tokens(&self) -> u64 {
        self.completion_tokens
    }

    /// How `other` differs from this answer, if it does.
    pub fn difference(&self, other: &Answer) -> Option<String> {
        if self == other {
            return None;
        }
        if let Some(i) = self
            .logprobs
            .iter()
            .zip(&other.logprobs)
            .position(|(a, b)| a != b)
        {
            return Some(format!(
                "token {i}: {:?} vs {:?}",
                self.logprobs[i], other.logprobs[i]
            ));
        }
        for (what, a, b) in [
            ("content", &self.content, &other.content),
            ("reasoning", &self.reasoning, &other.reasoning),
            ("finish_reason", &self.finish, &other.finish),
        ] {
            if a != b {
                return Some(format!("{what} {a:?} vs {b:?}"));
            }
        }
        Some(format!(
            "{} vs {} tokens, usage {}/{} vs {}/{}",
            self.logprobs.len(),
            other.logprobs.len(),
            self.prompt_tokens,
            self.completion_tokens,
            other.prompt_tokens,
            other.completion_tokens
        ))
    }
}

impl Client {
    /// Connects to the router at `addr`: it must be ready and serve a model.
    pub async fn connect(addr: SocketAddr, api_key: Option<String>) -> Result<Self, VerifyError> {
        let mut client = Self {
            addr,
            bearer: api_key.map(|k| format!("Bearer {k}")),
            model: String::new(),
        };
        let (status, body) = client.request("GET", "/health/ready", None).await?;
        if status != 200 {
            return Err(VerifyError::NotReady {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        let models = client.get_json("/v1/models").await?;
        let Some(id) = models["data"][0]["id"].as_str() else {
            return Err(VerifyError::NoModel { listing: models });
        };
        id.clone_into(&mut client.model);
        Ok(client)
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    async fn request(
        &self,
        method: &'static str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Vec<u8>), VerifyError> {
        let headers: Vec<(&str, &str)> = self
            .bearer
            .as_deref()
            .map(|b| vec![("authorization", b)])
            .unwrap_or_default();
        let response = common::http_client::request_with(
            self.addr,
            method,
            path,
            &headers,
            body.map(|b| ("application/json", b)),
            REQUEST_TIMEOUT,
        )
        .await
        .map_err(|source| VerifyError::Request {
            method,
            path: path.to_owned(),
            source,
        })?;
        Ok((response.status, response.body.to_vec()))
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), VerifyError> {
        self.request("POST", path, Some(body)).await
    }

    pub async fn get_json(&self, path: &str) -> Result<Value, VerifyError> {
        let (status, body) = self.request("GET", path, None).await?;
        json_ok(path, status, &body)
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Result<Value, VerifyError> {
        let (status, bytes) = self.post_raw(path, body.to_string().into_bytes()).await?;
        json_ok(path, status, &bytes)
    }

    /// A non-streamed chat completion.
    pub async fn chat(&self, body: &Value) -> Result<Answer, VerifyError> {
        let mut body = body.clone();
        body["stream"] = Value::Bool(false);
        let v = self.post_json("/v1/chat/completions", &body).await?;
        let choice = &v["choices"][0];
        let message = &choice["message"];
        Ok(Answer {
            content: message["content"].as_str().unwrap_or("").to_owned(),
            reasoning: message["reasoning_content"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            tool_calls: message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
            logprobs: logprobs_of(&choice["logprobs"]),
            finish: choice["finish_reason"].as_str().unwrap_or("").to_owned(),
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        })
    }

    /// A streamed chat completion, reassembled; an error event, or a stream that ends without
    /// `[DONE]`, is an error.
    pub async fn chat_stream(&self, body: &Value) -> Result<Answer, VerifyError> {
        let mut body = body.clone();
        body["stream"] = Value::Bool(true);
        body["stream_options"] = serde_json::json!({"include_usage": true});
        let (status, bytes) = self
            .post_raw("/v1/chat/completions", body.to_string().into_bytes())
            .await?;
        if status != 200 {
            return Err(VerifyError::StreamHttp {
                status,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            });
        }
        let text = String::from_utf8(bytes).map_err(|_| VerifyError::StreamNotUtf8)?;
        let mut answer = Answer {
            content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            logprobs: Vec::new(),
            finish: String::new(),
            prompt_tokens: 0,
            completion_tokens: 0,
        };
        let mut done = false;
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value =
                serde_json::from_str(data).map_err(|source| VerifyError::StreamEvent {
                    data: data.to_owned(),
                    source,
                })?;
            if chunk.get("error").is_some() {
                return Err(VerifyError::StreamErrorEvent {
                    data: data.to_owned(),
                });
            }
            if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
                answer.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                answer.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
            }
            let Some(choice) = chunk["choices"].get(0) else {
                continue;
            };
            let delta = &choice["delta"];
            answer
                .content
                .push_str(delta["content"].as_str().unwrap_or(""));
            answer
                .reasoning
                .push_str(delta["reasoning_content"].as_str().unwrap_or(""));
            if let Some(calls) = delta["tool_calls"].as_array() {
                answer.tool_calls.extend(calls.iter().cloned());
            }
            answer.logprobs.extend(logprobs_of(&choice["logprobs"]));
            if let Some(reason) = choice["finish_reason"].as_str() {
                reason.clone_into(&mut answer.finish);
            }
        }
        if !done {
            return Err(VerifyError::StreamUnterminated);
        }
        // Streamed tool calls arrive as deltas; compare them by their assembled arguments.
        answer.tool_calls = merge_tool_call_deltas(&answer.tool_calls);
        Ok(answer)
    }
}

fn json_ok(path: &str, status: u16, body: &[u8]) -> Result<Value, VerifyError> {
    if status != 200 {
        return Err(VerifyError::Http {
            path: path.to_owned(),
            status,
            body: String::from_utf8_lossy(body).into_owned(),
        });
    }
    serde_json::from_slice(body).map_err(|source| VerifyError::Json {
        path: path.to_owned(),
        source,
        body: String::from_utf8_lossy(body).into_owned(),
    })
}

/// Logprobs of the reasoning tokens, then of the content tokens.
fn logprobs_of(logprobs: &Value) -> Vec<(String, f64)> {
    ["reasoning_content", "content"]
        .iter()
        .filter_map(|k| logprobs[*k].as_array())
        .flatten()
        .map(|t| {
            (
                t["token"].as_str().unwrap_or("").to_owned(),
                t["logprob"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

/// Streamed tool-call deltas merged into whole calls, shaped like the non-streamed ones (id,
/// type, function name and the concatenated arguments).
fn merge_tool_call_deltas(deltas: &[Value]) -> Vec<Value> {
    let mut calls: Vec<Value> = Vec::new();
    for d in deltas {
        let index = d["index"].as_u64().unwrap_or(0) as usize;
        while calls.len() <= index {
            calls.push(serde_json::json!({"id": null, "type": "function",
                "function": {"name": "", "arguments": ""}}));
        }
        let call = &mut calls[index];
        if let Some(id) = d["id"].as_str() {
            call["id"] = Value::String(id.to_owned());
        }
        if let Some(name) = d["function"]["name"].as_str() {
            call["function"]["name"] = Value::String(name.to_owned());
        }
        if let Some(args) = d["function"]["arguments"].as_str() {
            let joined = format!(
                "{}{args}",
                call["function"]["arguments"].as_str().unwrap_or("")
            );
            call["function"]["arguments"] = Value::String(joined);
        }
    }
    calls
}

//! The chat template: the GGUF's Jinja `tokenizer.chat_template`, recognised as ChatML and
//! rendered in Rust. [`super::llama::Llama`] tokenizes the turns it yields.

use super::{ChatMessage, GenerateError};

/// How the chat template renders a conversation (ChatML, optionally with a default system turn).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ChatTemplate {
    /// Inserted as the first turn when the conversation does not start with a system message.
    pub default_system: Option<String>,
}

impl ChatTemplate {
    /// Recognises the GGUF's Jinja `tokenizer.chat_template`. We render it in Rust rather than
    /// run a template engine, so anything but ChatML is refused instead of mis-rendered.
    pub fn parse(template: Option<&str>) -> Result<ChatTemplate, GenerateError> {
        let Some(t) = template else {
            return Ok(ChatTemplate {
                default_system: None,
            });
        };
        let chatml = t.contains("<|im_start|>")
            && t.contains("<|im_end|>")
            && t.contains("message['role']")
            && t.contains("message['content']");
        if !chatml {
            return Err(GenerateError::Load(format!(
                "unsupported chat template (not ChatML): {t}"
            )));
        }
        let default_system = if t.contains("messages[0]['role'] != 'system'") {
            const OPEN: &str = "<|im_start|>system";
            let start = t.find(OPEN).ok_or_else(|| {
                GenerateError::Load("chat template inserts a system turn we cannot find".into())
            })? + OPEN.len();
            let body = &t[start..];
            let end = body.find("<|im_end|>").ok_or_else(|| {
                GenerateError::Load("chat template's system turn is not closed".into())
            })?;
            // The Jinja literal may spell the newline as an escape.
            let body = body[..end].replace("\\n", "\n");
            let body = body.strip_prefix('\n').unwrap_or(&body);
            Some(body.to_string())
        } else {
            None
        };
        Ok(ChatTemplate { default_system })
    }

    /// The (role, content) turns the template renders: the default system turn, if the
    /// conversation lacks one, then the messages.
    pub fn turns<'a>(
        &'a self,
        messages: &'a [ChatMessage],
    ) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let default = match (messages.first(), &self.default_system) {
            (Some(first), Some(system)) if first.role != "system" => {
                Some(("system", system.as_str()))
            }
            _ => None,
        };
        default.into_iter().chain(
            messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str())),
        )
    }

    /// The rendered text (what the Jinja template would produce), for tests.
    #[cfg(test)]
    pub fn render(&self, messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        for (role, content) in self.turns(messages) {
            out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        out + "<|im_start|>assistant\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_parsing_refuses_non_chatml() {
        assert!(ChatTemplate::parse(Some("{{ bos_token }}[INST] {{ message }}")).is_err());
        let plain = ChatTemplate::parse(Some(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
             message['content'] + '<|im_end|>\\n'}}{% endfor %}",
        ))
        .unwrap();
        assert_eq!(plain.default_system, None);
        assert_eq!(
            plain.render(&[ChatMessage::new("user", "x")]),
            "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}

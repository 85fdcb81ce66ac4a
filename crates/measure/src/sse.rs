//! An incremental Server-Sent Events parser: bytes in as the network delivers them, whole events out.
//! Handles `\n` and `\r\n` line ends, multi-line `data`, comments (keep-alives) and chunks that split
//! a line or a UTF-8 character anywhere.

/// One dispatched event. `event` is `message` when the server named none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

impl SseEvent {
    pub fn new(event: &str, data: &str) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
        }
    }
}

#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
    event: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    pub fn new() -> SseParser {
        SseParser::default()
    }

    /// Feeds a chunk; returns the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.pending.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            self.line(&line, &mut out);
        }
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            let event = self.event.take();
            if !self.data.is_empty() {
                out.push(SseEvent {
                    event: event.unwrap_or_else(|| "message".to_string()),
                    data: std::mem::take(&mut self.data).join("\n"),
                });
            }
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => self.event = Some(value.to_string()),
            "data" => self.data.push(value.to_string()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: &str, data: &str) -> SseEvent {
        SseEvent::new(event, data)
    }

    #[test]
    fn parses_named_events_and_skips_comments() {
        let mut p = SseParser::new();
        let got = p.push(
            b"event: sources\ndata: []\n\n: keep-alive\n\nevent: token\ndata: {\"text\":\"Hi\"}\n\n",
        );
        assert_eq!(
            got,
            vec![ev("sources", "[]"), ev("token", "{\"text\":\"Hi\"}")]
        );
    }

    #[test]
    fn events_split_across_chunks_and_crlf() {
        let stream =
            "event: token\r\ndata: {\"text\":\"é\"}\r\n\r\ndata: [DONE]\r\n\r\n".as_bytes();
        // Split at every byte, including inside the two-byte 'é'.
        let mut p = SseParser::new();
        let mut got = Vec::new();
        for b in stream {
            got.extend(p.push(std::slice::from_ref(b)));
        }
        assert_eq!(
            got,
            vec![ev("token", "{\"text\":\"é\"}"), ev("message", "[DONE]")]
        );
    }

    #[test]
    fn multi_line_data_joins_with_newlines_and_no_data_means_no_event() {
        let mut p = SseParser::new();
        let got = p.push(b"event: x\n\ndata: a\ndata:b\n\n");
        // The first block has no data: not dispatched, and its event name does not leak.
        assert_eq!(got, vec![ev("message", "a\nb")]);
        // An unterminated event is held back until its blank line.
        assert!(p.push(b"event: done\ndata: {}\n").is_empty());
        assert_eq!(p.push(b"\n"), vec![ev("done", "{}")]);
    }
}

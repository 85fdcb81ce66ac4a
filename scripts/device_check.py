#!/usr/bin/env python3
"""GPU device check for ragscope (Python standard library only; run by scripts/device-check).

Starts an OTLP/HTTP trace receiver in this process, starts `ragscope serve` on the given device
with a small built-in corpus, sends a fixed set of RAG queries and embedding batches, then
stops the server (which flushes its spans) and writes to --out:

  summary.json    figures and checks (decode/prefill tok/s, embedding throughput, peak GPU
                  memory, GPU spans per phase, nesting violations)
  spans.jsonl     every exported span (trace/span/parent ids, name, times, attributes)
  responses.jsonl the RAG responses (usage, timings, answer)
  metrics.txt     the last /metrics scrape
  server.log      the server's stderr

Exit status 0 only when every check passed.
"""

import argparse
import gzip
import http.server
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

# A small corpus in our own words, so the check needs no network.
CORPUS = [
    ("stash", "git stash pop applies the most recent stash entry to the working tree and removes "
     "it from the stash list; git stash apply keeps the entry."),
    ("clone", "git clone --depth 1 makes a shallow clone that downloads only the latest commits "
     "instead of the whole history; --shallow-since limits history by date."),
    ("amend", "git commit --amend replaces the tip of the current branch with a new commit, for "
     "example to fix a typo in the last commit message or add a forgotten file."),
    ("rebase", "In an interactive rebase todo list, fixup melds a commit into the previous one and "
     "discards its log message, while squash keeps both messages for editing."),
    ("log", "git log --follow keeps listing the history of a single file beyond renames."),
    ("bisect-skip", "git bisect skip tells Git the current commit cannot be tested, so it picks "
     "another nearby commit to test instead."),
    ("bisect-run", "With git bisect run, a script exits 0 for good, 1 to 127 for bad, and 125 "
     "when the current revision cannot be tested and should be skipped."),
    ("worktree", "git worktree lock keeps the administrative files of a linked worktree from being "
     "pruned, e.g. when it lives on a removable drive that is not always mounted."),
    ("branch", "git branch -d deletes a merged branch; -D deletes it even when it is not merged. "
     "git branch -m renames a branch."),
    ("reset", "git reset --soft HEAD~1 undoes the last commit but keeps its changes staged; "
     "git restore --staged unstages a file added by mistake."),
    ("remote", "git remote add origin URL registers a remote; git fetch downloads its objects and "
     "git pull fetches and merges them into the current branch."),
    ("tag", "git tag -a v1.0 -m message creates an annotated tag; git push --tags sends tags."),
]

# ---------------------------------------------------------------------------------------------
# OTLP/HTTP protobuf decoding (ExportTraceServiceRequest), just the fields the check needs.


def _varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf):
    """Yields (field number, wire type, value) of one protobuf message."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value = buf[i:i + 8]
            i += 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value = buf[i:i + n]
            i += n
        elif wire == 5:
            value = buf[i:i + 4]
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


def _any_value(buf):
    for f, _, v in _fields(buf):
        if f == 1:
            return v.decode()
        if f == 2:
            return bool(v)
        if f == 3:
            return v - (1 << 64) if v >= 1 << 63 else v
        if f == 4:
            return struct.unpack("<d", v)[0]
    return None


def _key_value(buf):
    key, value = None, None
    for f, _, v in _fields(buf):
        if f == 1:
            key = v.decode()
        elif f == 2:
            value = _any_value(v)
    return key, value


def decode_traces(body):
    spans = []
    for f, _, rs in _fields(body):
        if f != 1:
            continue
        service = None
        for f2, _, v2 in _fields(rs):
            if f2 == 1:  # Resource
                for f3, _, kv in _fields(v2):
                    if f3 == 1:
                        k, val = _key_value(kv)
                        if k == "service.name":
                            service = val
            elif f2 == 2:  # ScopeSpans
                for f3, _, sp in _fields(v2):
                    if f3 != 2:
                        continue
                    span = {"service": service, "attributes": {}, "parent_span_id": ""}
                    for f4, _, v4 in _fields(sp):
                        if f4 == 1:
                            span["trace_id"] = v4.hex()
                        elif f4 == 2:
                            span["span_id"] = v4.hex()
                        elif f4 == 4:
                            span["parent_span_id"] = v4.hex()
                        elif f4 == 5:
                            span["name"] = v4.decode()
                        elif f4 == 7:
                            span["start_ns"] = struct.unpack("<Q", v4)[0]
                        elif f4 == 8:
                            span["end_ns"] = struct.unpack("<Q", v4)[0]
                        elif f4 == 9:
                            k, val = _key_value(v4)
                            span["attributes"][k] = val
                    spans.append(span)
    return spans


class Receiver(http.server.BaseHTTPRequestHandler):
    spans = []
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            decoded = decode_traces(body)
            with Receiver.lock:
                Receiver.spans.extend(decoded)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


# ---------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, body=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def wait_ready(base, proc, deadline):
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(base + "/ready", timeout=5).read()
            return
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def median(xs):
    return statistics.median(xs) if xs else None


def nesting_violations(spans):
    """Spans whose interval leaves their parent's (parents missing from the export are skipped)."""
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    bad = []
    for s in spans:
        p = by_id.get((s["trace_id"], s["parent_span_id"]))
        if p is None:
            continue
        if s["start_ns"] < p["start_ns"] or s["end_ns"] > p["end_ns"]:
            bad.append({"span": s["name"], "parent": p["name"], "trace_id": s["trace_id"],
                        "start_before_ns": max(0, p["start_ns"] - s["start_ns"]),
                        "end_after_ns": max(0, s["end_ns"] - p["end_ns"])})
    return bad


def analyse(spans, device):
    gpu = [s for s in spans if s["name"].startswith("gpu ")]
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    orphans = [s["name"] for s in gpu if (s["trace_id"], s["parent_span_id"]) not in by_id]
    phases = {}
    for s in gpu:
        phase = s["name"][4:]
        a = s["attributes"]
        p = phases.setdefault(phase, {"count": 0, "device_ms": [], "gap_ms": [],
                                      "host_launch_ms": [], "parents": set()})
        p["count"] += 1
        p["device_ms"].append(a.get("gpu.device_ms", 0.0))
        p["gap_ms"].append(a.get("gpu.gap_ms", 0.0))
        p["host_launch_ms"].append(a.get("gpu.host_launch_ms", 0.0))
        parent = by_id.get((s["trace_id"], s["parent_span_id"]))
        if parent:
            p["parents"].add(parent["name"])
    phase_summary = {
        k: {"count": v["count"], "device_ms_p50": median(v["device_ms"]),
            "gap_ms_p50": median(v["gap_ms"]), "host_launch_ms_p50": median(v["host_launch_ms"]),
            "parents": sorted(v["parents"])}
        for k, v in phases.items()
    }
    prefill = [s for s in spans if s["name"] == "prefill"]
    decode = [s for s in spans if s["name"] == "decode"]
    # Prefill throughput on the device: the prompt tokens over the `gpu prefill` device time.
    gpu_prefill_tps = []
    for s in gpu:
        if s["name"] != "gpu prefill":
            continue
        parent = by_id.get((s["trace_id"], s["parent_span_id"]))
        ms = s["attributes"].get("gpu.device_ms", 0.0)
        if parent and ms > 0:
            gpu_prefill_tps.append(parent["attributes"].get("gen_ai.usage.input_tokens", 0)
                                   / (ms / 1e3))
    violations = nesting_violations(spans)
    gpu_violations = [v for v in violations if v["span"].startswith("gpu ")]
    want = {"embed", "prefill", "decode_step"} if device != "cpu" else set()
    checks = {
        "spans_received": len(spans) > 0,
        "gpu_spans_for_every_phase": want <= set(phases),
        "gpu_spans_have_exported_parents": not orphans,
        "gpu_spans_nest_in_host_spans": not gpu_violations,
        "all_spans_nest": not violations,
    }
    return {
        "span_count": len(spans),
        "gpu_phases": phase_summary,
        "prefill_tokens_per_second_p50": median(
            [s["attributes"].get("rag.prefill.tokens_per_second", 0.0) for s in prefill]),
        "prefill_tokens_per_second_device_p50": median(gpu_prefill_tps),
        "decode_tokens_per_second_p50": median(
            [s["attributes"].get("rag.decode.tokens_per_second", 0.0) for s in decode]),
        "nesting_violations": violations[:50],
        "gpu_orphans": orphans[:50],
        "checks": checks,
    }


def metric_value(text, name):
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--queries", default="eval/questions.jsonl")
    ap.add_argument("--n-queries", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--embed-rounds", type=int, default=5)
    ap.add_argument("--ready-timeout", type=float, default=240)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.time()

    rport, sport = free_port(), free_port()
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", rport), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()

    data_dir = tempfile.mkdtemp(prefix="ragscope-device-data-")
    env = dict(os.environ)
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rport}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRICS_EXPORTER": "none",
        "RAGSCOPE_TOKEN_TRACE": "spans",
        "RAGSCOPE_GPU_DECODE_SAMPLE": "4",
        "RUST_LOG": env.get("RUST_LOG", "info"),
    })
    cmd = [args.binary, "serve", "--device", args.device, "--listen", f"127.0.0.1:{sport}",
           "--models-dir", args.models_dir, "--fetch-models", "false", "--corpus", "none",
           "--data-dir", os.path.abspath(data_dir), "--grpc-listen", "off"]
    log = open(os.path.join(args.out, "server.log"), "w")
    # --grpc-listen exists only where the gRPC API is merged; retry without it.
    help_text = subprocess.run([args.binary, "serve", "--help"], capture_output=True,
                               text=True).stdout
    if "--grpc-listen" not in help_text:
        cmd = cmd[:-2]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{sport}"
    summary = {"device": args.device, "command": " ".join(cmd)}
    try:
        t0 = time.time()
        wait_ready(base, proc, time.time() + args.ready_timeout)
        summary["ready_s"] = round(time.time() - t0, 2)
        docs = [{"id": i, "text": t, "source": f"device-check/{i}"} for i, t in CORPUS]
        http_json(base + "/v1/documents", {"documents": docs})

        # Embedding throughput: batches of 64 passages, after one warm-up batch.
        passages = [t for _, t in CORPUS] * 6
        batch = passages[:64]
        http_json(base + "/v1/embeddings", {"input": batch, "model": "all-MiniLM-L6-v2"})
        t0 = time.time()
        for _ in range(args.embed_rounds):
            http_json(base + "/v1/embeddings", {"input": batch, "model": "all-MiniLM-L6-v2"})
        took = time.time() - t0
        summary["embedding_inputs_per_second"] = round(args.embed_rounds * len(batch) / took, 1)

        questions = [json.loads(line)["question"] for line in open(args.queries)][:args.n_queries]
        responses = []
        http_json(base + "/v1/rag/query", {"query": questions[0], "max_tokens": 8})  # warm-up
        for q in questions:
            r = http_json(base + "/v1/rag/query",
                          {"query": q, "max_tokens": args.max_tokens, "seed": 1})
            responses.append({"query": q, "answer": r.get("answer"), "usage": r.get("usage"),
                              "timings": r.get("timings"), "finish_reason": r.get("finish_reason")})
        with open(os.path.join(args.out, "responses.jsonl"), "w") as f:
            for r in responses:
                f.write(json.dumps(r) + "\n")
        out_tokens = sum((r["usage"] or {}).get("completion_tokens", 0) or 0 for r in responses)
        decode_s = sum((r["timings"] or {}).get("decode_ms", 0) for r in responses) / 1e3
        summary["client_decode_tokens_per_second"] = (
            round(out_tokens / decode_s, 1) if decode_s else None)
        metrics = http_json(base + "/metrics")
        with open(os.path.join(args.out, "metrics.txt"), "w") as f:
            f.write(metrics)
        summary["gpu_memory_bytes"] = {
            "used": metric_value(metrics, "ragscope_gpu_memory_used_bytes"),
            "peak": metric_value(metrics, "ragscope_gpu_memory_peak_bytes"),
            "total": metric_value(metrics, "ragscope_gpu_memory_total_bytes"),
            "kv_cache": metric_value(metrics, "ragscope_gpu_kv_cache_bytes"),
        }
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            summary["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            summary["nvidia_smi"] = None
    except Exception as e:  # noqa: BLE001 (report whatever broke, with the server log)
        summary["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        time.sleep(0.5)
        receiver.shutdown()

    with Receiver.lock:
        spans = list(Receiver.spans)
    with open(os.path.join(args.out, "spans.jsonl"), "w") as f:
        for s in spans:
            f.write(json.dumps(s) + "\n")
    summary.update(analyse(spans, args.device))
    summary["checks"]["no_error"] = "error" not in summary
    summary["ok"] = all(summary["checks"].values())
    summary["wall_s"] = round(time.time() - started, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: summary[k] for k in ("ok", "checks", "wall_s")}, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()

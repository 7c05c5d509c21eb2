#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<name>/) from the fixtures in tests/data and
the unit tests' cases. Run from anywhere: python3 tests/fuzz/make_seeds.py. Deterministic; the corpus of
gpu_step (inputs the fuzzer itself found, merged small) is kept as committed and not rewritten here."""
import json
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")


def put(name, file, data):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, file), "wb") as f:
        f.write(data)


def read(*parts):
    with open(os.path.join(DATA, *parts), "rb") as f:
        return f.read()


# ---- safetensors: a few small tensors of tiny-v4's second shard, single-file and index forms ----------------
def safetensors_seeds():
    shard = read("tiny-v4", "model-00002-of-00002.safetensors")
    (n,) = struct.unpack("<Q", shard[:8])
    header = json.loads(shard[8:8 + n])
    data = shard[8 + n:]
    picked, dtypes = {}, set()
    for name, t in sorted(header.items()):  # small tensors, one per dtype
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        if e - b <= 512 and t["dtype"] not in dtypes:
            dtypes.add(t["dtype"])
            picked[name] = (t, data[b:e])
    out_header, blob = {}, b""
    for name, (t, raw) in picked.items():
        out_header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    out_header["__metadata__"] = {"format": "pt"}
    h = json.dumps(out_header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    file = struct.pack("<Q", len(h)) + h + blob
    put("safetensors", "single", b"S" + file)
    index = {"metadata": {"total_size": len(blob)},
             "weight_map": {name: "model-00001-of-00001.safetensors" for name in picked}}
    put("safetensors", "index", b"I" + json.dumps(index, indent=2).encode() + b"\0" + file)
    # Broken forms the unit tests use: header length past the end, overlapping offsets, unknown dtype.
    put("safetensors", "bad-length", b"S" + struct.pack("<Q", 1 << 40) + b"{}")
    bad = dict(out_header)
    first = next(iter(picked))
    bad[first] = dict(bad[first], dtype="F7")
    hb = json.dumps(bad).encode()
    put("safetensors", "bad-dtype", b"S" + struct.pack("<Q", len(hb)) + hb + blob)
    put("safetensors", "index-escape", b"I" + json.dumps({"weight_map": {first: "../x.safetensors"}}).encode() + b"\0")


# ---- config.json: the three fixture configs -----------------------------------------------------------------
def config_seeds():
    put("config", "tiny-v4.json", read("tiny-v4", "config.json"))
    put("config", "demo-v4.json", read("demo-v4", "config.json"))
    put("config", "v4-flash-0731.json", read("v4-flash-0731.config.json"))


# ---- tokenizer.json: tiny-v4's tokenizer cut to its first 300 ids (merges kept when their parts remain) --------
def tokenizer_seeds():
    tok = json.loads(read("tiny-v4", "tokenizer.json"))
    vocab = {k: v for k, v in tok["model"]["vocab"].items() if v < 300}
    merges = []
    for m in tok["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges[:200]
    config = read("tiny-v4", "tokenizer_config.json")
    put("tokenizer_load", "tiny-v4-cut", json.dumps(tok, ensure_ascii=False).encode() + b"\0" + config)
    plain = dict(tok, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
                 added_tokens=tok["added_tokens"][:2])
    put("tokenizer_load", "bytelevel-regex", json.dumps(plain, ensure_ascii=False))
    cases = json.loads(read("tiny-v4", "tokenizer_cases.json"))["cases"]
    for i, c in enumerate(cases):
        put("tokenizer_codec", "case%02d" % i, bytes([i % 8]) + c["text"].encode("utf-8"))
    put("tokenizer_codec", "invalid-utf8", b"\x02ab\xff\xfe\xc3(\xe2\x82")


# ---- chat: the encoder tests' messages, and completions with reasoning and DSML tool calls -------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
     "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
E2 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "content": "",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                     "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 22, \"condition\": \"sunny\"}"},
    {"role": "assistant", "reasoning_content": "Got the weather data.", "content": "It is sunny, 22°C."}]
E1 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "reasoning_content": "The user said hello.", "content": "Hi there!"},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
BODIES = {
    "e1": {"messages": E1},
    "e2-tools": {"messages": E2, "tools": TOOLS},
    "developer-reminder": {"messages": [{"role": "developer", "content": "Be brief."},
                                        {"role": "latest_reminder", "content": "today is Monday"},
                                        {"role": "user", "content": "Hi", "wo_eos": True}]},
    "prefix": {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,", "prefix": True}]},
    "response-format": {"messages": [{"role": "user", "content": "JSON please", "response_format": {"type": "json_object"}},
                                     {"role": "tool", "content": [{"type": "text", "text": "r1"}]}]},
}
E = "<｜end▁of▁sentence｜>"
DSML_CALL = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
COMPLETIONS = {
    "reasoning": (1, "The user asks about France. It is Paris.</think>The capital of France is Paris." + E),
    "tool-call": (3, "I should use the tool.</think>Let me check." + DSML_CALL + E),
    "bare-invoke": (2, "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">x</｜DSML｜parameter>\n</｜DSML｜invoke>" + E),
    "tool-in-reasoning": (3, "thinking <｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls> after" + E),
    "cut-off": (2, "Sure." + DSML_CALL[:70]),
    "stray": (0, "<｜begin▁of▁sentence｜>hi</think> there <think>x" + E),
}


def chat_seeds():
    for i, (name, body) in enumerate(sorted(BODIES.items())):
        put("chat_encode", name, bytes([i * 37 % 256]) + json.dumps(body, ensure_ascii=False).encode())
    for name, (flags, text) in sorted(COMPLETIONS.items()):
        put("chat_parse", name, bytes([flags, 7]) + text.encode("utf-8"))


# ---- REST: one body per endpoint, as the gateway tests send them ---------------------------------------------
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
          "/detokenize", "/v1/models", "/health", "/metrics"]
REST = {
    "completion-text": (0, {"prompt": "Hello, world!", "max_tokens": 6, "return_token_ids": True, "logprobs": 2}),
    "completion-ids": (0, {"prompt": [[47, 477], [86]], "n": 2, "stop": ["lo"], "stream": True,
                           "stream_options": {"include_usage": True}, "logit_bias": {"47": 5}}),
    "chat": (1, {"messages": E1, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    "chat-tools-stream": (1, {"messages": E2[:2], "tools": TOOLS, "stream": True, "reasoning_effort": "high",
                              "thinking": {"type": "enabled"}}),
    "messages": (2, {"model": "tiny-v4", "max_tokens": 8, "system": "Be brief.",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search",
                                                                     "input": {"query": "x"}}]},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                "content": "found"}]}],
                     "tools": [{"name": "search", "description": "d", "input_schema": {"type": "object"}}],
                     "stream": True, "thinking": {"type": "enabled", "budget_tokens": 100}}),
    "count-tokens": (3, {"messages": [{"role": "user", "content": "Hello"}], "system": [{"type": "text", "text": "S"}]}),
    "tokenize-prompt": (4, {"prompt": "Hello, world!", "add_special_tokens": False, "return_token_strs": True}),
    "tokenize-messages": (4, {"messages": E1, "tools": TOOLS}),
    "detokenize": (5, {"tokens": [0, 47, 477, 86, 2, 5]}),
    "models": (6, {}),
}


def rest_seeds():
    for name, (route, body) in sorted(REST.items()):
        put("rest_request", name, bytes([route]) + json.dumps(body, ensure_ascii=False).encode())


# ---- gRPC: GenerateRequest / TokenizeRequest in protobuf wire format (protoc --encode) ------------------------
GRPC = {
    "text": (0, "GenerateRequest", 'text: "Hello, world!" max_tokens: 4 sampling { temperature: 0.5 top_k: 3 }'),
    "token-ids": (0, "GenerateRequest", 'token_ids { ids: [47, 477, 86] } n: 2 logprobs: true top_logprobs: 3 '
                                        'stop: "lo" stop_token_ids: [1]'),
    "chat": (0, "GenerateRequest", 'chat { messages { role: "system" content: "S" } messages { role: "user" '
                                   'content: "Hi" } thinking: true reasoning_effort: "high" } max_tokens: 6'),
    "bias": (0, "GenerateRequest", 'text: "x" sampling { logit_bias { key: 47 value: 2 } seed: 7 min_p: 0.1 '
                                   'repetition_penalty: 1.1 }'),
    "tokenize": (1, "TokenizeRequest", 'text: "Hello, world! <｜User｜>"'),
}


def grpc_seeds():
    proto_dir = os.path.join(ROOT, "proto")
    for name, (flag, msg, text) in sorted(GRPC.items()):
        wire = subprocess.run(["protoc", "-I", proto_dir, "--encode=numoe.v1." + msg, "numoe/v1/inference.proto"],
                              input=text.encode(), stdout=subprocess.PIPE, check=True).stdout
        put("grpc_request", name, bytes([flag]) + wire)


if __name__ == "__main__":
    safetensors_seeds()
    config_seeds()
    tokenizer_seeds()
    chat_seeds()
    rest_seeds()
    grpc_seeds()
    print("seeds written under", OUT, file=sys.stderr)

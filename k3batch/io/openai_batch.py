"""OpenAI Batch API input lines as job rows (`input.format = "openai"`).

A line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. custom_id is the row's id; body.messages (chat) or body.prompt (completions: a
string or token ids) is its prompt; the body's sampling fields override the job's for the row
(`_SAMPLING`). A line that asks for what the job cannot do (an unknown url, a method other than
POST, n > 1, top_logprobs, a field in `_UNSUPPORTED`) is that row's error, naming the field; its
custom_id is kept so the error line of the output still names the request. The model named in
the body is kept in the `model` column: the tokenize step compares it with the job's.
"""

import pyarrow as pa

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
COLUMNS = {  # the table of an OpenAI input file, always these columns in this order
    "id": pa.string(),  # custom_id
    "url": pa.string(),
    "model": pa.string(),
    "messages": _MESSAGES,
    "prompt": pa.string(),
    "prompt_token_ids": pa.list_(pa.int64()),
    "max_new_tokens": pa.int64(),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "seed": pa.uint64(),
    "stop": pa.list_(pa.string()),
    "logprobs": pa.bool_(),  # the sampled tokens' log-probabilities, per row
}
# body field -> row column; max_completion_tokens wins over max_tokens when both are given
_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
}
# Fields the engine has no equivalent for: a value other than these defaults is a row error.
_UNSUPPORTED = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "stream": False,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}


def is_chat(url: str | None) -> bool:
    return url == CHAT_URL


def request_row(obj: dict) -> tuple[dict, str | None]:
    """(row, error) of one parsed request line; on error the row holds what is known (id)."""
    custom_id = obj.get("custom_id")
    row = {"id": custom_id if isinstance(custom_id, str) else None}
    if not isinstance(custom_id, str) or not custom_id:
        return row, f"custom_id = {custom_id!r} must be a non-empty string"
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return row, f"method = {method!r}: only 'POST' is supported"
    if url not in (CHAT_URL, COMPLETIONS_URL):
        return row, f"url = {url!r}: expected {CHAT_URL!r} or {COMPLETIONS_URL!r}"
    if not isinstance(body, dict):
        return row, "body must be a JSON object"
    row["url"] = url
    row["model"] = body.get("model")
    if url == CHAT_URL:
        if "messages" not in body:
            return row, "body.messages is missing"
        row["messages"] = body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            row["prompt_token_ids"] = prompt
        elif isinstance(prompt, str):
            row["prompt"] = prompt
        else:
            return row, "body.prompt must be a string or a list of token ids (one prompt)"
    n = body.get("n", 1)
    if n != 1:
        return row, f"body.n = {n!r}: only n = 1 is supported"
    for field, default in _UNSUPPORTED.items():
        if body.get(field, default) not in (default, None):
            return row, f"body.{field} is not supported"
    for field, column in _SAMPLING.items():
        if body.get(field) is not None:  # in _SAMPLING's order: max_completion_tokens last
            row[column] = body[field]
    error = _logprobs(body, row, chat=url == CHAT_URL)
    return row, error


def _logprobs(body: dict, row: dict, *, chat: bool) -> str | None:
    """Chat: logprobs true, top_logprobs 0 or absent. Completions: logprobs 0 (the sampled
    token only). The engine keeps no alternatives, so top-k log-probabilities are an error."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs not in (None, True, False):
            return f"body.logprobs = {logprobs!r} must be true or false"
        if top not in (None, 0):
            return f"body.top_logprobs = {top!r}: only the sampled token's log-probability is kept"
        row["logprobs"] = bool(logprobs)
    else:
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            return f"body.logprobs = {logprobs!r}: only 0 (the sampled token's) is supported"
        row["logprobs"] = logprobs == 0
    return None


def response_line(
    *, line_id: str, custom_id: str | None, chat: bool, model: str, row: dict,
    created: int, token_text=None,
) -> dict:  # fmt: skip
    """One OpenAI Batch API output line for a finished row (`result.RESULT_TYPES` keys).

    line_id: unique and stable per input row (the line's "id"; the body's id and request_id are
    made from it). chat: a chat.completion body, else a text_completion. token_text(id) -> str
    spells a token for log-probabilities (needed only when the row has them). A row with an
    error becomes {"response": null, "error": {"code", "message"}}."""
    if row.get("error") is not None:
        error = {"code": "row_error", "message": row["error"]}
        return {"id": line_id, "custom_id": custom_id, "response": None, "error": error}
    text = row.get("generated_text") or ""
    finish = row.get("finish_reason") or "stop"
    usage = {
        "prompt_tokens": row["num_prompt_tokens"],
        "completion_tokens": row["num_output_tokens"],
        "total_tokens": row["num_prompt_tokens"] + row["num_output_tokens"],
    }
    logprobs = row.get("output_logprobs")
    tokens = row.get("output_token_ids") or []
    suffix = line_id.removeprefix("batch_req_")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}  # fmt: skip
        if logprobs is not None:
            choice["logprobs"] = {"content": [
                {"token": (s := token_text(t)), "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": []}
                for t, lp in zip(tokens, logprobs)
            ]}  # fmt: skip
        body = {"id": f"chatcmpl-{suffix}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if logprobs is not None:
            spelled = [token_text(t) for t in tokens]
            offsets = [sum(len(s) for s in spelled[:i]) for i in range(len(spelled))]
            choice["logprobs"] = {"tokens": spelled, "token_logprobs": list(logprobs),
                                  "top_logprobs": None, "text_offset": offsets}  # fmt: skip
        body = {"id": f"cmpl-{suffix}", "object": "text_completion"}
    body |= {"created": created, "model": model, "choices": [choice], "usage": usage}
    response = {"status_code": 200, "request_id": f"req_{suffix}", "body": body}
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}

"""The benchmark client's reading of a stream: which chunk is the first token."""

from kvgate_bench.stream_client import carries_token


def test_the_first_token_is_the_first_chunk_with_text_or_an_end() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    word = {"choices": [{"index": 0, "delta": {"content": " the"}, "finish_reason": None}]}
    text = {"choices": [{"index": 0, "text": " the", "finish_reason": None}]}
    # A first token that is end-of-sequence: vLLM sends its end with no text.
    eos = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
    eos_chat = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    assert not carries_token(role)
    assert not carries_token(usage)
    assert carries_token(word) and carries_token(text)
    assert carries_token(eos) and carries_token(eos_chat)

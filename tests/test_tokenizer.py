from vllm_sim import tokenizer


def test_one_word_is_one_token_and_prefixes_agree() -> None:
    """Identical text up to a word boundary gives identical leading token ids."""
    a = tokenizer.encode("the quick brown fox")
    b = tokenizer.encode("the quick brown fox jumps over")
    assert len(a) == 4
    assert b[:4] == a


def test_chat_template_costs_two_tokens_per_message_plus_one() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there friend"}]
    text = tokenizer.render_chat(msgs)
    assert tokenizer.count(text) == 2 + 3 + tokenizer.chat_overhead_tokens(2)


def test_generated_words_retokenize_to_the_same_count() -> None:
    words = tokenizer.output_words(7, 25)
    assert tokenizer.count(tokenizer.decode_words(words)) == 25
    assert tokenizer.output_words(7, 25) == words


def test_filler_words_are_deterministic_per_key() -> None:
    assert tokenizer.filler_words(3, 512) == tokenizer.filler_words(3, 512)
    assert tokenizer.filler_words(3, 512) != tokenizer.filler_words(4, 512)
    assert len(tokenizer.encode(" ".join(tokenizer.filler_words(3, 512)))) == 512

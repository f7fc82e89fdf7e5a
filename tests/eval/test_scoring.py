"""nlearn.eval.scoring without lm-eval: the padded lengths that bound compilations, and which families'
decoding caches grow with the stream (what the adapter reports for stream-mode rolling)."""

from eval_helpers import small_config, split_model
from nlearn.eval.scoring import Scorer, bucket_length


def test_bucket_lengths_are_powers_of_two_then_multiples_of_the_chunk():
    assert [bucket_length(n, 64) for n in (1, 16, 17, 33, 64, 65, 128, 129)] == [16, 16, 32, 64, 64, 128, 128, 192]
    assert bucket_length(40, 48) == 48  # a power of two past a chunk that is not one: the chunk
    assert len({bucket_length(n, 512) for n in range(1, 513)}) == 6  # 16 ... 512: six compiled shapes


def test_full_attention_caches_grow_and_memories_do_not():
    cases = [("transformer", {}), ("transformer", {"window": 8}), ("deltanet", {}), ("titans_lmm", {})]
    grows = [Scorer(*split_model(small_config(family, **extra)), chunk_size=16).cache_grows()
             for family, extra in cases]
    assert grows == [True, False, False, False], list(zip(cases, grows))

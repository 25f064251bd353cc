"""`CorpusIndex` (lookups in a corpus of the target's earlier outputs) against a brute-force reference, and its
errors."""

import gzip
import json
import random

import pytest

from angelspec_hf.policy import CorpusIndex
from angelspec_hf.policy.corpus import LOOKUP_CORPUS_FILE


def reference(sequences, ids, num_tokens, max_match, min_match, full_match):
    """Scan every sequence: the longest suffix of `ids` (<= max_match) that occurs, then depth by depth the most
    frequent next token among the occurrences still on the path (ties: the smaller id), and its confidence."""
    texts = [list(s) for s in sequences]
    tail = list(ids)[-max_match:]
    best_n, ends = 0, []
    for n in range(1, len(tail) + 1):
        pattern = tail[len(tail) - n:]
        found = [(i, j + n) for i, t in enumerate(texts) for j in range(len(t) - n + 1) if t[j:j + n] == pattern]
        if not found:
            break
        best_n, ends = n, found
    if best_n < min_match:
        return [], []
    tokens, confidences = [], []
    for depth in range(num_tokens):
        nexts = [texts[i][e + depth] if e + depth < len(texts[i]) else None for i, e in ends]
        counts = {}
        for t in nexts:
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        tokens.append(token)
        confidences.append(counts[token] / len(nexts) * min(1.0, (best_n + depth) / full_match))
        ends = [(i, e) for (i, e), t in zip(ends, nexts) if t == token]
    return tokens, confidences


@pytest.mark.parametrize("seed", range(4))
def test_continuations_equal_a_brute_force_scan(seed):
    """Random corpora over a small vocabulary (so matches are long and ties frequent), contexts taken from the corpus
    and random ones: the same tokens and confidences as scanning every sequence."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 40])
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 12))]
    kwargs = dict(max_match=rng.choice([4, 8, 32]), min_match=rng.choice([1, 2, 3]), full_match=rng.choice([1, 5]))
    kwargs["min_match"] = min(kwargs["min_match"], kwargs["max_match"])
    index = CorpusIndex(sequences, **kwargs)
    assert len(index) == sum(len(s) for s in sequences)
    for _ in range(60):
        source = rng.choice(sequences)
        if source and rng.random() < 0.7:
            start = rng.randrange(len(source))
            ids = source[start:start + rng.randrange(1, 12)]
        else:
            ids = [rng.randrange(vocab + 2) for _ in range(rng.randrange(1, 10))]
        num_tokens = rng.randrange(0, 8)
        got = index.continuation(ids, num_tokens)
        want = reference(sequences, ids, num_tokens, **kwargs)
        assert got[0] == want[0], (ids, got, want)
        assert got[1] == pytest.approx(want[1])


def test_no_match_or_continuation_crosses_from_one_sequence_into_the_next():
    index = CorpusIndex([[1, 2, 3], [4, 5, 6]], min_match=1)
    assert index.continuation([3], 4) == ([], [])  # 3 ends its sequence: nothing follows it
    assert index.continuation([2, 3], 4) == ([], [])
    assert index.continuation([1, 2], 4)[0] == [3]  # not [3, 4, 5, 6]
    tokens, _ = index.continuation([9, 3, 4], 2)  # "3 4" spans the two sequences: only "4" matches
    assert tokens == [5, 6]


def test_confidence_weighs_the_share_of_occurrences_and_the_matched_length():
    index = CorpusIndex([[1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 8], [5, 2, 3, 9]], min_match=1, full_match=4)
    tokens, confidences = index.continuation([1, 2, 3], 1)  # 2 of 3 occurrences go on with 9, matched 3 of 4
    assert tokens == [9] and confidences[0] == pytest.approx(2 / 3 * 3 / 4)
    tokens, confidences = index.continuation([0, 2, 3], 1)  # only "2 3" matches: 3 of 4 go on with 9, 2 of 4
    assert tokens == [9] and confidences[0] == pytest.approx(3 / 4 * 2 / 4)


def test_a_tensor_context_reads_as_its_list():
    import torch

    index = CorpusIndex([[1, 2, 3, 4, 5]], min_match=1)
    assert index.continuation(torch.tensor([9, 2, 3]), 3) == index.continuation([9, 2, 3], 3)


def test_from_regenerated_reads_both_file_formats(tmp_path):
    rows = [{"id": "a", "response_ids": [1, 2, 3, 4]}, {"id": "b", "response_ids": [1, 2, 5]}]
    with gzip.open(tmp_path / "math.jsonl.gz", "wt") as f:
        f.write(json.dumps(rows[0]) + "\n")
    (tmp_path / "code.jsonl").write_text(json.dumps(rows[1]) + "\n")
    index = CorpusIndex.from_regenerated(tmp_path, min_match=1)
    assert index.num_sequences == 2 and len(index) == 7
    assert CorpusIndex.from_regenerated(tmp_path, sets=["code"], min_match=1).continuation([1, 2], 2)[0] == [5]
    with pytest.raises(FileNotFoundError, match="regenerate"):
        CorpusIndex.from_regenerated(tmp_path, sets=["chat"])
    with pytest.raises(FileNotFoundError, match="no regenerated responses"):
        CorpusIndex.from_regenerated(tmp_path / "empty")


@pytest.mark.parametrize("sequences, kwargs, message", [
    ([], {}, "at least one sequence"),
    ([[1, -2]], {}, ">= 0"),
    ([[1]], {"min_match": 0}, "min_match"),
    ([[1]], {"min_match": 5, "max_match": 4}, "min_match"),
    ([[1]], {"full_match": 0}, "full_match"),
])
def test_bad_arguments_get_a_clear_error(sequences, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CorpusIndex(sequences, **kwargs)


@pytest.mark.parametrize("top", [49151, 70000])  # uint16 tokens where every id fits, else int32
def test_a_saved_corpus_loads_back_equal_with_its_settings(tmp_path, top):
    rng = random.Random(top)
    sequences = [[rng.randrange(top + 1) for _ in range(rng.randrange(0, 40))] for _ in range(30)] + [[top], []]
    index = CorpusIndex(sequences, max_match=12, min_match=3, full_match=5)
    path = index.save(tmp_path, source="unit test")
    assert path == tmp_path / LOOKUP_CORPUS_FILE
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert str(f.get_tensor("tokens").dtype) == ("uint16" if top < 2**16 else "int32")
        assert f.metadata()["source"] == "unit test"
    loaded = CorpusIndex.load(tmp_path)
    assert [s.tolist() for s in loaded.sequences()] == sequences
    assert (loaded.max_match, loaded.min_match, loaded.full_match) == (12, 3, 5)
    assert CorpusIndex.load(path, min_match=1).min_match == 1  # settings given override the saved ones
    for seq in sequences[:10]:
        for cut in range(len(seq)):
            assert loaded.continuation(seq[:cut + 1], 6) == index.continuation(seq[:cut + 1], 6)


def test_from_path_reads_a_corpus_file_a_folder_holding_one_or_replies(tmp_path):
    (tmp_path / "replies").mkdir()
    (tmp_path / "replies" / "code.jsonl").write_text(json.dumps({"id": "a", "response_ids": [1, 2, 3]}) + "\n")
    CorpusIndex([[4, 5, 6, 7]]).save(tmp_path)
    assert len(CorpusIndex.from_path(tmp_path)) == 4 and len(CorpusIndex.from_path(tmp_path / LOOKUP_CORPUS_FILE)) == 4
    assert len(CorpusIndex.from_path(tmp_path / "replies")) == 3
    assert all(CorpusIndex.is_source(p) for p in (tmp_path, tmp_path / LOOKUP_CORPUS_FILE, tmp_path / "replies"))
    assert not CorpusIndex.is_source(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no regenerated responses"):
        CorpusIndex.from_path(tmp_path / "nowhere")


def test_a_file_that_is_not_a_corpus_is_refused(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not a lookup corpus"):
        CorpusIndex.load(tmp_path / "model.safetensors")
    save_file({"tokens": np.arange(5, dtype=np.uint16), "lengths": np.array([2, 2])},
              str(tmp_path / LOOKUP_CORPUS_FILE), metadata={"format": "angelspec-lookup-corpus/1"})
    with pytest.raises(ValueError, match="do not add up"):
        CorpusIndex.load(tmp_path)


def test_a_drafter_folder_brings_its_corpus_when_loaded(tmp_path):
    """`lookup_corpus.safetensors` in a drafter's folder becomes `drafter.lookup_corpus` however the drafter is
    loaded (`load_drafter`, `AutoModel.from_pretrained`); a folder without one gives None."""
    from transformers import AutoModel

    import angelspec_hf
    from helpers import tiny_drafter, tiny_target

    tiny_drafter("dfly", tiny_target()).save_pretrained(tmp_path)
    assert angelspec_hf.load_drafter(str(tmp_path)).lookup_corpus is None
    CorpusIndex([[5, 6, 7, 8], [5, 6, 9]]).save(tmp_path)
    for drafter in (angelspec_hf.load_drafter(str(tmp_path)), AutoModel.from_pretrained(str(tmp_path))):
        assert drafter.lookup_corpus.num_sequences == 2 and drafter.lookup_corpus.continuation([1, 5, 6, 7], 1)[0] == [8]


def test_a_growing_corpus_proposes_what_was_added_within_its_window():
    """`GrowingCorpus`: a sequence added is looked up from then on; the window keeps the last `window_tokens` tokens
    (whole sequences, the oldest dropped first); the longer match of base and window wins, the window's on a tie."""
    from angelspec_hf.policy import GrowingCorpus

    base = CorpusIndex([[1, 2, 3, 4, 5], [7, 8, 9, 10]], min_match=2)
    grow = GrowingCorpus(base, window_tokens=12, rebuild_share=None)  # re-indexed at the first lookup after an add
    assert (grow.max_match, grow.min_match, grow.full_match) == (base.max_match, 2, base.full_match)
    assert grow.continuation([0, 2, 3], 2) == base.continuation([0, 2, 3], 2) and grow.recent is None
    grow.add([20, 21, 22, 23, 24])
    assert grow.continuation([9, 20, 21], 3)[0] == [22, 23, 24] and len(grow) == len(base) + 5
    assert grow.num_sequences == 3
    grow.add([2, 3, 40, 41])  # matches [2, 3] as long as the base does: the window's proposal
    assert grow.continuation([0, 2, 3], 2)[0] == [40, 41]
    assert grow.continuation([1, 2, 3], 2)[0] == [4, 5]  # the base matches [1, 2, 3]: longer
    grow.add([30, 31, 32, 33, 34])  # 14 tokens > 12: the oldest sequence goes
    assert grow.continuation([9, 20, 21], 3) == ([], []) and grow._recent_tokens == 9
    grow.add([5, 6])  # too short to propose anything after a match: not kept
    grow.add(list(range(100, 130)))  # longer than the window: its last 12 tokens
    assert grow._recent_tokens == 12 and grow.continuation([118, 119], 2)[0] == [120, 121]
    assert grow.continuation([100, 101], 2) == ([], [])
    alone = GrowingCorpus(None, window_tokens=8, rebuild_share=None)
    assert alone.continuation([1, 2], 3) == ([], []) and len(alone) == 0
    alone.add([1, 2, 3, 4])
    assert alone.continuation([1, 2], 3)[0] == [3, 4]
    for window in (0, GrowingCorpus.MAX_WINDOW_TOKENS + 1):
        with pytest.raises(ValueError, match="window_tokens"):
            GrowingCorpus(base, window_tokens=window)
    with pytest.raises(ValueError, match=">= 0"):
        alone.add([1, -2, 3])


def test_a_growing_corpus_rebuilds_at_most_its_share_of_the_time(monkeypatch):
    """With `rebuild_share`, additions wait for the next rebuild until the time since the last one is the last
    rebuild's duration over the share; lookups meanwhile read the index as last built."""
    from angelspec_hf.policy import GrowingCorpus
    from angelspec_hf.policy import corpus as corpus_module

    now = [100.0]
    monkeypatch.setattr(corpus_module.time, "perf_counter", lambda: now[0])
    grow = GrowingCorpus(None, window_tokens=64, rebuild_share=0.1)
    grow.add([1, 2, 3, 4])
    assert grow.continuation([1, 2], 2)[0] == [3, 4]  # the first index is built at once
    grow._build_seconds = 0.5  # as if that build took 0.5 s: the next may come 5 s after it
    grow.add([7, 8, 9])
    now[0] += 4.0
    assert grow.continuation([7, 8], 1) == ([], [])  # not yet re-indexed
    now[0] += 1.0
    assert grow.continuation([7, 8], 1)[0] == [9]


def test_a_file_that_is_not_safetensors_is_refused_with_a_clear_error(tmp_path):
    (tmp_path / "code.jsonl.gz").write_bytes(b"not a corpus")
    assert not CorpusIndex.is_source(tmp_path / "code.jsonl.gz") and CorpusIndex.is_source(tmp_path)
    with pytest.raises(ValueError, match="not a lookup corpus"):
        CorpusIndex.from_path(tmp_path / "code.jsonl.gz")


def test_a_drafter_with_an_unreadable_corpus_still_loads(tmp_path):
    import angelspec_hf
    from helpers import tiny_drafter, tiny_target

    tiny_drafter("dfly", tiny_target()).save_pretrained(tmp_path)
    (tmp_path / LOOKUP_CORPUS_FILE).write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="without corpus lookups"):
        drafter = angelspec_hf.load_drafter(str(tmp_path))
    assert drafter.lookup_corpus is None and type(drafter).__name__ == "DFlyDrafter"

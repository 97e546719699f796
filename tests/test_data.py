"""plait.data: bundled corpus and tokenizer, token files, train/val samples, dp batching, MLM masks."""

import hashlib
import json
import math
import pickle

import numpy as np
import pytest
import torch

from plait.data import (
    DistributedBatches,
    TokenDataset,
    build_token_file,
    bundled_corpus_path,
    bundled_token_file,
    bundled_tokenizer_path,
    epoch_permutation,
    load_bundled_text,
    load_tokens,
    mask_tokens,
    read_token_meta,
)

tokenizers = pytest.importorskip("tokenizers")

CORPUS_SHA256 = "7ded71ac6001ee3f25e5befd8295dc00a42ad99d40704b751b2fd553670c5138"
SPECIALS = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "<|endoftext|>": 5}
EOS = 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("plait_cache")


@pytest.fixture(scope="module")
def text(cache):
    return load_bundled_text(cache)


@pytest.fixture(scope="module")
def tok():
    t = tokenizers.Tokenizer.from_file(str(bundled_tokenizer_path()))
    t.encode_special_tokens = True
    return t


def test_bundled_corpus_is_the_world_english_bible(cache, text):
    raw = text.encode("utf-8")
    assert len(raw) == 4_996_554 and len(raw) > 4_000_000
    assert hashlib.sha256(raw).hexdigest() == CORPUS_SHA256
    lines = text.splitlines()
    assert len(lines) == 33_391
    assert "In the beginning, God created the heavens and the earth." == lines[35][:56]
    assert "Jesus wept." in text
    assert "<note" not in text and "&amp;" not in text and "  " not in text
    # Notes are removed without gluing words together or leaving a space before punctuation.
    assert "God created" in text and "coins? Not one" in text
    # Cached: a second call returns the same file without rewriting it.
    p = bundled_corpus_path(cache)
    mtime = p.stat().st_mtime_ns
    assert bundled_corpus_path(cache) == p and p.stat().st_mtime_ns == mtime


def test_tokenizer_round_trips_and_compresses(text, tok):
    assert tok.get_vocab_size() == 8192
    assert {s: tok.token_to_id(s) for s in SPECIALS} == SPECIALS
    sample = text[:200_000]
    ids = tok.encode(sample, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == sample
    assert 4.0 < len(sample) / len(ids) < 4.6  # ~4.3 characters per token on this corpus
    odd = "  Tabs\tand\r\nCRLF, Ünïcödé 🚀, <|endoftext|> [MASK] literal, trailing  \n\n"
    assert tok.decode(tok.encode(odd).ids, skip_special_tokens=False) == odd
    assert EOS not in tok.encode(odd).ids  # literal special-token text is just text
    assert tok.encode("In the beginning").tokens == ["In", "Ġthe", "Ġbeginning"]


def _docs_blank_line(s):
    docs, cur = [], []
    for line in s.replace("\r\n", "\n").splitlines(keepends=True):
        if line.strip():
            cur.append(line)
        elif cur:
            docs.append("".join(cur).removesuffix("\n"))
            cur = []
    if cur:
        docs.append("".join(cur).removesuffix("\n"))
    return docs


def _direct(tok, docs):
    return [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [EOS]]


def test_token_file_matches_direct_encoding(tmp_path, text, tok):
    # ~120 kB slice of the corpus, cut into documents by blank lines every 50 lines.
    lines = text.splitlines()[30:1530]
    body = "\n".join("\n".join(lines[i : i + 50]) + "\n" for i in range(0, len(lines), 50))
    src = tmp_path / "slice.txt"
    src.write_text(body, encoding="utf-8")
    out = build_token_file([src], bundled_tokenizer_path(), tmp_path / "slice.bin")
    tokens = load_tokens(out)
    docs = _docs_blank_line(body)
    assert len(docs) == 30
    expect = _direct(tok, docs)
    assert tokens.dtype == np.uint16 and tokens.tolist() == expect
    assert tok.decode(tokens.tolist(), skip_special_tokens=False) == "".join(
        d + "<|endoftext|>" for d in docs
    )
    meta = read_token_meta(out)
    assert meta["num_tokens"] == len(expect) == out.stat().st_size // 2
    assert meta["num_documents"] == 30 and meta["vocab_size"] == 8192 and meta["eos_id"] == EOS
    assert (
        meta["tokenizer_sha256"]
        == hashlib.sha256(bundled_tokenizer_path().read_bytes()).hexdigest()
    )
    assert meta["sources"][0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert json.loads((tmp_path / "slice.bin.json").read_text()) == meta


@pytest.mark.parametrize("mode", ["blank_line", "line", "file"])
def test_document_boundaries_and_awkward_whitespace(tmp_path, tok, mode):
    s = "First doc line.\n  indented line  \ntrailing space \nEnd.\n\n \nSecond <|endoftext|> doc.\n\n\n\tTabbed\r\nlast"
    out = build_token_file(text=s, out_path=tmp_path / "t.bin", doc_boundary=mode)
    lines = s.replace("\r\n", "\n").splitlines(keepends=True)
    docs = {
        "blank_line": _docs_blank_line(s),
        "line": [ln.removesuffix("\n") for ln in lines if ln.strip()],
        "file": [s.replace("\r\n", "\n")],
    }[mode]
    assert len(docs) == {"blank_line": 3, "line": 7, "file": 1}[mode]
    assert load_tokens(out).tolist() == _direct(tok, docs)
    assert read_token_meta(out)["num_documents"] == len(docs)


def test_pretokenized_sources_and_errors(tmp_path, tok):
    a = np.array([7, 8, 9, EOS], dtype=np.int32)
    np.save(tmp_path / "a.npy", a)
    b = build_token_file(text="Hello world.", out_path=tmp_path / "b.bin")
    both = build_token_file([tmp_path / "a.npy", b], out_path=tmp_path / "both.bin", text="Amen.")
    expect = [7, 8, 9, EOS] + _direct(tok, ["Hello world."]) + _direct(tok, ["Amen."])
    assert load_tokens(both).tolist() == expect
    assert [s["kind"] for s in read_token_meta(both)["sources"]] == ["tokens", "tokens", "text"]
    np.save(tmp_path / "bad.npy", np.array([1, 8192]))
    with pytest.raises(ValueError, match=r"span \[1, 8192\].*vocab_size 8192"):
        build_token_file([tmp_path / "bad.npy"], out_path=tmp_path / "x.bin")
    with pytest.raises(ValueError, match="ids up to 8191.*uint32"):
        build_token_file(text="x", out_path=tmp_path / "x.bin", dtype=np.uint8)
    (tmp_path / "raw.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="pass dtype="):
        load_tokens(tmp_path / "raw.bin")
    assert load_tokens(tmp_path / "raw.bin", dtype=np.uint16).tolist() == list(range(10))


@pytest.fixture()
def arange_tokens(tmp_path):
    path = tmp_path / "arange.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))
    return path


def test_train_val_split_is_disjoint_and_covering(arange_tokens):
    train = TokenDataset(arange_tokens, seq_len=16, split="train", val_fraction=0.1)
    val = TokenDataset(arange_tokens, seq_len=16, split="val", val_fraction=0.1)
    assert (len(train), len(val)) == (56, 6)  # (900 - 1) // 16, (100 - 1) // 16
    x, y = train[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert x.tolist() == list(range(48, 64)) and y.tolist() == list(range(49, 65))
    assert val[0][0].tolist() == list(range(900, 916)) and val[-1][1][-1].item() == 996
    train_inputs = torch.cat([train[i][0] for i in range(len(train))]).tolist()
    val_inputs = torch.cat([val[i][0] for i in range(len(val))]).tolist()
    train_seen = {t for i in range(len(train)) for t in train.window(i).tolist()}
    val_seen = {t for i in range(len(val)) for t in val.window(i).tolist()}
    assert train_seen.isdisjoint(val_seen)
    assert train_inputs == list(range(896)) and val_inputs == list(
        range(900, 996)
    )  # tiles, tails < 16
    xb, yb = train.get_batch([3, 0])
    assert xb.shape == (2, 16) and torch.equal(xb[0], x) and torch.equal(yb[1], train[0][1])
    assert pickle.loads(pickle.dumps(train))[5][0].tolist() == list(range(80, 96))
    with pytest.raises(ValueError, match="val split .* has 10 tokens .* seq_len \\+ 1 = 17"):
        TokenDataset(arange_tokens, seq_len=16, split="val", val_fraction=0.01)
    with pytest.raises(IndexError):
        train[56]


def _sample_ids(batch, seq_len=4):
    return (
        batch["input_ids"][:, 0] // seq_len
    ).tolist()  # arange tokens: sample i starts at i*seq_len


@pytest.fixture()
def ds(arange_tokens):
    return TokenDataset(arange_tokens, seq_len=4, val_fraction=0.0)  # 249 samples


def _run(ds, b, dp, seed=3, steps=None, state=None, drop_last=True):
    """Global order of samples handed out by ranks 0..dp-1 in lockstep, and the final state."""
    loaders = [DistributedBatches(ds, b, r, dp, seed=seed, drop_last=drop_last) for r in range(dp)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    iters = [iter(ld) for ld in loaders]
    order, n = [], 0
    while steps is None or n < steps:
        batches = [next(it, None) for it in iters]
        if batches[0] is None:
            assert all(bt is None for bt in batches)
            break
        for bt in batches:
            assert bt["input_ids"].shape[1] == 4 and torch.equal(
                bt["labels"][:, :-1], bt["input_ids"][:, 1:]
            )
            order += _sample_ids(bt)
        n += 1
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)
    return order, states[0]


def test_dp_shards_are_disjoint_and_interleave_to_the_dp1_order(ds):
    assert len(ds) == 249
    one, _ = _run(ds, b=4, dp=1)
    perm = epoch_permutation(249, 3, 0).tolist()
    assert one == perm[:248]
    two, _ = _run(ds, b=2, dp=2)
    assert two == perm[:248]  # rank 0's and rank 1's micro-batches at each step = next 2 of dp=1
    r0 = [i for bt in DistributedBatches(ds, 2, 0, 2, seed=3) for i in _sample_ids(bt)]
    r1 = [i for bt in DistributedBatches(ds, 2, 1, 2, seed=3) for i in _sample_ids(bt)]
    assert set(r0).isdisjoint(r1) and len(r0) == len(r1) == 124
    assert r0[:4] == perm[0:2] + perm[4:6] and r1[:4] == perm[2:4] + perm[6:8]


def test_order_is_deterministic_and_changes_with_seed_and_epoch(ds):
    a = DistributedBatches(ds, 8, seed=11)
    b = DistributedBatches(ds, 8, seed=11)
    e0a = [bt["input_ids"] for bt in a]
    e0b = [bt["input_ids"] for bt in b]
    assert len(e0a) == len(a) == 31 and all(torch.equal(x, y) for x, y in zip(e0a, e0b))
    assert a.state_dict() == {"epoch": 1, "position": 0, "seed": 11, "num_samples": 249}
    e1 = [i for bt in a for i in _sample_ids(bt)]
    e0 = [i for x in e0a for i in (x[:, 0] // 4).tolist()]
    assert e1 != e0 and e1 == epoch_permutation(249, 11, 1).tolist()[:248]
    assert _sample_ids(next(iter(DistributedBatches(ds, 8, seed=12)))) != e0[:8]


@pytest.mark.parametrize("new_b,new_dp", [(2, 2), (3, 1), (1, 3)])
def test_resume_continues_exactly_with_same_or_other_dp(ds, new_b, new_dp):
    full, _ = _run(ds, b=2, dp=2, steps=None)  # epoch 0 without interruption: 248 samples
    head, state = _run(ds, b=2, dp=2, steps=25)
    assert state == {"epoch": 0, "position": 100, "seed": 3, "num_samples": 249}
    tail, end = _run(ds, b=new_b, dp=new_dp, state=state)
    assert head == full[:100]
    g = new_b * new_dp
    assert tail == epoch_permutation(249, 3, 0).tolist()[100 : 100 + (149 // g) * g]
    assert len(set(head + tail)) == len(head + tail)  # nothing repeated
    if g in (1, 4):
        assert head + tail == full[: len(head + tail)]
    assert end["epoch"] == 1 and end["position"] == 0
    # Resuming across an epoch boundary: state at the end of epoch 0 starts epoch 1 at its start.
    nxt, _ = _run(ds, b=new_b, dp=new_dp, state=end, steps=2)
    assert nxt == epoch_permutation(249, 3, 1).tolist()[: 2 * g]


def test_drop_last_false_gives_every_rank_the_same_number_of_steps(ds):
    loaders = [DistributedBatches(ds, 20, r, 3, seed=0, drop_last=False) for r in range(3)]
    per_rank = [[bt["input_ids"].shape[0] for bt in ld] for ld in loaders]
    assert [len(s) for s in per_rank] == [5, 5, 5] and len(loaders[0]) == 5  # ceil(249 / 60)
    assert [s[-1] for s in per_rank] == [9, 0, 0]  # 249 - 4 * 60 = 9 left for the last step
    seen = [
        i
        for ld in [DistributedBatches(ds, 20, r, 3, seed=0, drop_last=False) for r in range(3)]
        for bt in ld
        for i in _sample_ids(bt)
    ]
    assert sorted(seen) == list(range(249))


def test_sampler_errors_name_the_numbers(ds):
    with pytest.raises(
        ValueError,
        match="249 samples cannot fill one step of micro_batch_size 50 x dp_size 8 = 400",
    ):
        DistributedBatches(ds, 50, 0, 8)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        DistributedBatches(ds, 4, 2, 2)
    ld = DistributedBatches(ds, 4, seed=1)
    with pytest.raises(ValueError, match="seed 3"):
        ld.load_state_dict({"epoch": 0, "position": 0, "seed": 3, "num_samples": 249})
    with pytest.raises(ValueError, match="over 100 samples but the dataset has 249"):
        ld.load_state_dict({"epoch": 0, "position": 0, "seed": 1, "num_samples": 100})


def test_mask_tokens_follows_bert_80_10_10():
    g = torch.Generator().manual_seed(0)
    vocab, mask_id, specials = 8192, 4, [0, 1, 2, 3, 4, 5]
    ids = torch.randint(6, vocab, (64, 512), generator=g)
    ids[:, 0], ids[:, -40:] = 2, 0  # [CLS] and padding
    before = ids.clone()
    masked, labels = mask_tokens(
        ids, mask_id, vocab, specials, prob=0.15, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(ids, before) and masked.dtype == labels.dtype == torch.int64
    sel = labels != -100
    eligible = ids >= 6
    n = int(eligible.sum())  # 64 * 471 = 30144
    assert n == 30144 and not sel[~eligible].any()
    k = int(sel.sum())

    def within(count, total, p):  # 5 standard deviations of a binomial
        return abs(count - total * p) < 5 * math.sqrt(total * p * (1 - p))

    assert within(k, n, 0.15)
    assert torch.equal(labels[sel], ids[sel]) and torch.equal(masked[~sel], ids[~sel])
    to_mask = int((masked[sel] == mask_id).sum())
    unchanged = int((masked[sel] == ids[sel]).sum())
    to_random = k - to_mask - unchanged
    assert (
        within(to_mask, k, 0.8)
        and within(unchanged, k, 0.1 + 0.1 / (vocab - 6))
        and within(to_random, k, 0.1 * (1 - 1 / (vocab - 6)))
    )
    assert (
        int(masked[sel & (masked != mask_id)].min()) >= 6
    )  # random replacements are never special
    again = mask_tokens(ids, mask_id, vocab, specials, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], masked) and torch.equal(again[1], labels)
    with pytest.raises(ValueError, match=r"span \[0, 9000\]"):
        mask_tokens(torch.tensor([0, 9000]), mask_id, vocab, specials)


def test_bundled_token_file_builds_once_into_the_cache(tmp_path, text, tok):
    import lzma
    import shutil

    data = tmp_path / "data"  # a stand-in data dir holding a 50 kB slice, to keep the test fast
    data.mkdir()
    piece = text[:50_000]
    (data / "web_bible.txt.xz").write_bytes(lzma.compress(piece.encode("utf-8")))
    shutil.copy(bundled_tokenizer_path(), data / "tokenizer.json")
    out = bundled_token_file(tmp_path / "cache", data_dir=data)
    assert load_tokens(out).tolist() == _direct(tok, _docs_blank_line(piece))
    mtime = out.stat().st_mtime_ns
    assert (
        bundled_token_file(tmp_path / "cache", data_dir=data) == out
        and out.stat().st_mtime_ns == mtime
    )
    with pytest.raises(FileNotFoundError, match="pass data_dir="):
        bundled_token_file(tmp_path / "cache", data_dir=tmp_path / "nowhere")


def test_batches_from_a_plain_map_style_dataset():
    data = [(torch.full((3,), i), torch.full((3,), i + 1)) for i in range(10)]
    got = list(DistributedBatches(data, 3, 2, 3, seed=5, drop_last=False))  # rank 2 of 3
    perm = epoch_permutation(10, 5, 0).tolist()
    assert [bt["input_ids"][:, 0].tolist() for bt in got] == [perm[6:9], []]
    assert got[1]["input_ids"].shape == (0, 3) and torch.equal(
        got[0]["labels"], got[0]["input_ids"] + 1
    )

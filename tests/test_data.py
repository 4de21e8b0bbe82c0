"""jaxfuse.data on tiny files: every reader and its errors, the tokenizers, the loss masks of each
record kind, packing invariants, the token cache (reused, rebuilt, never half-written) and
resumable batches."""

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxfuse import data
from jaxfuse.data import cache as cache_module
from jaxfuse.data import records as records_module

EOS = "<|endoftext|>"
BOS = "<s>"
# Roles are added tokens, an assistant turn ends with EOS: the assistant tokens are exactly its
# content and EOS.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{{ '<|' + m['role'] + '|>' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Packing rows of tokens, best fit.",
          "Naïve café, ünïcode ☃ and 123 numbers.", "What is two plus two? It is four."] * 4
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "It is four."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, the lazy dog says."}]


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
  """A checkpoint's tokenizer: a byte-level BPE that adds a BOS, with EOS, role tokens and a
  chat template, saved with save_pretrained."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import PreTrainedTokenizerFast

  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS, BOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(CORPUS, trainer=trainer)
  bpe.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bpe.token_to_id(BOS))])
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=BOS)
  tokenizer.add_special_tokens({"additional_special_tokens": [
      "<|system|>", "<|user|>", "<|assistant|>"]})
  tokenizer.chat_template = CHAT_TEMPLATE
  directory = tmp_path_factory.mktemp("checkpoint")
  tokenizer.save_pretrained(str(directory))
  return directory


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint_dir):
  return data.load_tokenizer(checkpoint_dir)


# Reading records.

def test_reads_each_format_from_a_directory_in_sorted_order(tmp_path):
  _write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"messages": CHAT[1:3]},
                                      {"prompt": "p", "completion": "c", "extra": 1}])
  with open(tmp_path / "a.jsonl", "a") as f:
    f.write("\n   \n" + json.dumps({"text": "four", "messages": None}) + "\n")
  (tmp_path / "b.json").write_text(json.dumps({"text": "from json"}) + "\n")
  pq.write_table(pa.table({"text": ["r0", None], "messages": [None, CHAT[1:3]]}),
                 tmp_path / "d.parquet")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "c.txt").write_text("a whole file\n\nis one document\n")
  (tmp_path / ".hidden.jsonl").write_text('{"text": "skipped"}\n')
  (tmp_path / "notes.md").write_text("not data")

  records = list(data.read_records(tmp_path))
  where = [os.path.relpath(r.source, tmp_path) for r in records]
  assert where == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "a.jsonl:6", "b.json:1",
                   "d.parquet:row 0", "d.parquet:row 1", os.path.join("sub", "c.txt")]
  assert [r.kind for r in records] == ["text", "chat", "prompt_completion", "text", "text",
                                       "text", "chat", "text"]
  assert records[1].messages == tuple(CHAT[1:3]) == records[6].messages
  assert (records[2].prompt, records[2].completion) == ("p", "c")
  assert [records[i].text for i in (0, 3, 4, 5)] == ["one", "four", "from json", "r0"]
  assert records[7].text == "a whole file\n\nis one document\n"
  globbed = data.read_records(str(tmp_path / "**" / "*.txt"))
  assert [r.text for r in globbed] == [records[7].text]


def test_the_text_field_can_be_named(tmp_path):
  path = _write_jsonl(tmp_path / "b.jsonl", [{"body": "custom"}, {"text": "plain"}])
  with pytest.raises(data.DataError, match=r"b\.jsonl:2: a record needs 'body' \(text\)"):
    list(data.read_records(path, text_field="body"))
  assert next(data.read_records(path, text_field="body")).text == "custom"


def test_parquet_is_read_in_record_batches(tmp_path, monkeypatch):
  monkeypatch.setattr(records_module, "PARQUET_BATCH_ROWS", 2)
  texts = [f"row {i}" for i in range(5)]
  pq.write_table(pa.table({"text": texts, "other": list(range(5))}), tmp_path / "t.parquet")
  records = list(data.read_records(tmp_path / "t.parquet"))
  assert [r.text for r in records] == texts
  assert [r.source.rsplit(":", 1)[1] for r in records] == [f"row {i}" for i in range(5)]


BAD_FILES = [
    ("bad.jsonl", '{"text": "a"}\n\n{"text": \n', ["bad.jsonl:3:", "malformed JSON"]),
    ("array.json", '[{"text": "a"}]\n{"text": "b"}\n', ["array.json:1:", "not one array"]),
    ("fields.jsonl", '{"text": "a"}\n{"body": "b", "id": 1}\n',
     ["fields.jsonl:2:", "'text' (text), 'messages' (chat) or 'prompt' and 'completion'",
      "it has ['body', 'id']"]),
    ("prompt_only.jsonl", '{"prompt": "a"}\n', ["prompt_only.jsonl:1:", "it has ['prompt']"]),
    ("type.jsonl", '{"text": "a"}\n{"text": 5}\n', ["type.jsonl:2:", "'text' is a int"]),
    ("completion.jsonl", '{"prompt": "a", "completion": ["b"]}\n',
     ["completion.jsonl:1:", "'completion' is a list"]),
    ("content.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "x"}]}\n',
     ["content.jsonl:1:", "message 1 has no 'content'"]),
    ("role.jsonl", '{"messages": [{"role": 1, "content": "hi"}]}\n',
     ["role.jsonl:1:", "message 0's 'role' is a int"]),
    ("messages.jsonl", '{"messages": "hi"}\n', ["messages.jsonl:1:", "'messages' is a str"]),
    ("object.jsonl", '["text"]\n', ["object.jsonl:1:", "expected a JSON object"]),
    ("empty.jsonl", "\n\n", ["empty.jsonl: no records"]),
    ("notes.csv", "text\n", ["notes.csv: unsupported format '.csv'"]),
]


@pytest.mark.parametrize("name,content,expected", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_files_are_data_errors_naming_file_and_line(tmp_path, name, content, expected):
  (tmp_path / name).write_text(content)
  with pytest.raises(data.DataError) as error:
    list(data.read_records(tmp_path / name))
  assert str(error.value).startswith(str(tmp_path / name))
  for fragment in expected:
    assert fragment in str(error.value)


def test_bad_parquet_and_paths_are_data_errors(tmp_path):
  pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "columns.parquet")
  with pytest.raises(data.DataError, match=r"columns\.parquet: .*columns are \['body', 'n'\]"):
    list(data.read_records(tmp_path / "columns.parquet"))
  pq.write_table(pa.table({"prompt": ["a", "b", "c"], "completion": ["x", None, "z"]}),
                 tmp_path / "rows.parquet")
  with pytest.raises(data.DataError, match=r"rows\.parquet:row 1: a record needs"):
    list(data.read_records(tmp_path / "rows.parquet"))
  with pytest.raises(data.DataError, match=r"missing\.jsonl: no such file or directory"):
    list(data.read_records(tmp_path / "missing.jsonl"))
  with pytest.raises(data.DataError, match=r"\*\.parquet: no .* files matched the pattern"):
    list(data.read_records(str(tmp_path / "nothing" / "*.parquet")))
  (tmp_path / "empty").mkdir()
  with pytest.raises(data.DataError, match=r"empty: no .* files in the directory"):
    list(data.read_records(tmp_path / "empty"))


# Tokenizers.

def test_byte_tokenizer_round_trips_utf8():
  tokenizer = data.ByteTokenizer()
  text = "naïve café ☃ 𝄞"
  ids = tokenizer.encode(text)
  assert ids == list(text.encode("utf-8")) and max(ids) < 256
  assert tokenizer.decode(ids) == text
  assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.chat_template) == (256, None, None)


def test_trained_tokenizer_loads_with_auto_tokenizer(tmp_path):
  from transformers import AutoTokenizer

  out = tmp_path / "tokenizer"
  trained = data.train_tokenizer(CORPUS, 300, out)
  loaded = AutoTokenizer.from_pretrained(str(out))
  text = "The lazy fox: naïve ☃!"
  assert loaded.decode(loaded.encode(text)) == text
  assert loaded.encode(text) == trained.encode(text)
  assert loaded.eos_token == EOS and loaded.eos_token_id == trained.eos_token_id is not None
  assert 257 <= len(loaded) <= 300
  assert len(loaded.encode("the lazy dog")) < len("the lazy dog")   # it learned merges
  assert data.tokenizer_fingerprint(loaded) == data.tokenizer_fingerprint(trained)
  assert data.tokenizer_fingerprint(loaded) != data.tokenizer_fingerprint(data.ByteTokenizer())
  ids, mask = data.encode_record(data.Record("t", "text", text="fox"), loaded)
  assert ids[-1] == loaded.eos_token_id and mask.all()
  with pytest.raises(data.TokenizerError, match="vocab_size must be at least 257"):
    data.train_tokenizer(CORPUS, 100, tmp_path / "small")


def test_load_tokenizer_errors_name_the_directory(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(data.TokenizerError, match=r"empty: no tokenizer files \(tokenizer\.json"):
    data.load_tokenizer(tmp_path / "empty")
  with pytest.raises(data.TokenizerError, match=r"nowhere: no such directory"):
    data.load_tokenizer(tmp_path / "nowhere")


def test_vocabulary_checks(hf_tokenizer, tmp_path):
  data.check_vocabulary(hf_tokenizer, len(hf_tokenizer), "ckpt")     # padded vocabularies fit
  data.check_vocabulary(hf_tokenizer, len(hf_tokenizer) + 64, "ckpt")
  with pytest.raises(data.VocabularyError, match=rf"ckpt: the tokenizer has {len(hf_tokenizer)}"):
    data.check_vocabulary(hf_tokenizer, len(hf_tokenizer) - 1, "ckpt")
  path = _write_jsonl(tmp_path / "t.jsonl", [{"text": "ABC"}, {"text": "xyz"}])
  with pytest.raises(data.VocabularyError, match=r"bytes: the tokenizer has 256 tokens"):
    data.prepare(path, None, tmp_path / "cache", seq=8, batch_size=1, vocab_size=100)
  with pytest.raises(data.VocabularyError, match=r"t\.jsonl:2: token id 122 is past"):
    data.build_cache(path, data.ByteTokenizer(), tmp_path / "cache", vocab_size=100)
  assert list((tmp_path / "cache").iterdir()) == []


# Encoding.

def _runs(mask):
  """[start, stop) of each run of ones."""
  edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_text_gets_the_tokenizers_bos_and_eos(hf_tokenizer):
  ids, mask = data.encode_record(data.Record("a", "text", text="the lazy dog"), hf_tokenizer)
  body = hf_tokenizer.encode("the lazy dog", add_special_tokens=False)
  assert ids.tolist() == [hf_tokenizer.bos_token_id, *body, hf_tokenizer.eos_token_id]
  assert ids.dtype == np.int32 and mask.dtype == np.uint8 and mask.all()
  ids, mask = data.encode_record(data.Record("a", "text", text="é"), data.ByteTokenizer())
  assert ids.tolist() == [195, 169] and mask.tolist() == [1, 1]


@pytest.mark.parametrize("loss_on", data.LOSS_ON)
def test_prompt_completion_masks(hf_tokenizer, loss_on):
  record = data.Record("a", "prompt_completion", prompt="What is two plus two?",
                       completion=" It is four.")
  ids, mask = data.encode_record(record, hf_tokenizer, loss_on=loss_on)
  assert ids[0] == hf_tokenizer.bos_token_id and ids[-1] == hf_tokenizer.eos_token_id
  if loss_on == "all":
    assert mask.all()
  else:
    assert _runs(mask) == [(len(ids) - sum(mask), len(ids))]
    assert hf_tokenizer.decode(ids[mask == 1]) == " It is four." + EOS
    assert hf_tokenizer.decode(ids[mask == 0]) == BOS + "What is two plus two?"
  byte_ids, byte_mask = data.encode_record(record, data.ByteTokenizer(), loss_on=loss_on)
  assert bytes(byte_ids.astype(np.uint8)) == b"What is two plus two? It is four."
  assert byte_mask.sum() == (len(byte_ids) if loss_on == "all" else len(" It is four."))


def test_chat_masks_cover_exactly_the_assistant_turns(hf_tokenizer):
  record = data.Record("c.jsonl:7", "chat", messages=tuple(CHAT))
  ids, mask = data.encode_record(record, hf_tokenizer)
  rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False)
  assert hf_tokenizer.decode(ids) == rendered and rendered.startswith(BOS + "<|system|>")
  learned = [hf_tokenizer.decode(ids[a:b]) for a, b in _runs(mask)]
  assert learned == [m["content"] + EOS for m in CHAT if m["role"] == "assistant"]
  ids_all, mask_all = data.encode_record(record, hf_tokenizer, loss_on="all")
  assert ids_all.tolist() == ids.tolist() and mask_all.all()


def test_chat_errors_name_the_record(hf_tokenizer, tmp_path):
  record = data.Record("c.jsonl:7", "chat", messages=tuple(CHAT))
  with pytest.raises(data.DataError, match=r"c\.jsonl:7: a chat record needs a tokenizer with a "
                                           r"chat template"):
    data.encode_record(record, data.ByteTokenizer())
  # A template that starts with the message count renders no conversation's beginning as a
  # prefix of the whole, and one that upper-cases the contents does not render the assistant's.
  shouting = CHAT_TEMPLATE.replace("m['content']", "(m['content']|upper)")
  hf_tokenizer.chat_template, template = "{{ messages|length }}" + shouting, CHAT_TEMPLATE
  try:
    with pytest.raises(data.ChatTemplateError, match=r"c\.jsonl:7: .* not prefix-stable"):
      data.encode_record(record, hf_tokenizer)
    assert data.encode_record(record, hf_tokenizer, loss_on="all")[1].all()
  finally:
    hf_tokenizer.chat_template = template
  path = _write_jsonl(tmp_path / "chat.jsonl", [{"text": "a"}, {"messages": CHAT}])
  with pytest.raises(data.DataError, match=r"chat\.jsonl:2: a chat record needs"):
    data.prepare(path, None, tmp_path / "cache", seq=8, batch_size=1)
  assert not any((tmp_path / "cache").iterdir())


# Packing.

def _check_rows(rows, plan, seq, mask):
  """The invariants of packed rows whose token at each position is its index in the cache."""
  tokens, targets = rows["tokens"], rows["targets"]
  segments, positions = rows["segment_ids"], rows["positions"]
  assert all(v.dtype == np.int32 and v.shape == (plan.num_rows, seq) for v in rows.values())
  for r in range(plan.num_rows):
    seg = segments[r]
    used = int((seg > 0).sum())
    assert (seg[used:] == 0).all() and (targets[r, used:] == data.IGNORE_INDEX).all()
    pieces = plan.pieces[plan.row_offsets[r]:plan.row_offsets[r + 1]]
    assert used == pieces[:, 2].sum() <= seq
    assert seg[:used].tolist() == [k + 1 for k, p in enumerate(pieces) for _ in range(p[2])]
    for k in range(1, len(pieces) + 1):
      where = np.flatnonzero(seg == k)
      assert positions[r, where].tolist() == list(range(len(where)))
      assert (np.diff(tokens[r, where]) == 1).all()            # one contiguous piece
      inner = where[:-1]
      expected = np.where(mask[tokens[r, inner + 1]] == 1, tokens[r, inner + 1], -100)
      assert targets[r, inner].tolist() == expected.tolist()   # the same piece's next token
      assert targets[r, where[-1]] == data.IGNORE_INDEX        # never across a boundary


def test_packing_invariants_on_random_lengths():
  rng = np.random.default_rng(0)
  for trial in range(40):
    seq = int(rng.integers(2, 40))
    lengths = rng.integers(0, 3 * seq, size=int(rng.integers(1, 40)))
    if not lengths.any():
      lengths[0] = 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.arange(offsets[-1], dtype=np.int32)        # each token names its own position
    mask = rng.integers(0, 2, size=len(ids)).astype(np.uint8)
    for mode in data.LONG_DOCUMENTS:
      plan = data.plan_packing(lengths, seq, long_documents=mode)
      again = data.plan_packing(lengths, seq, long_documents=mode)
      assert np.array_equal(plan.pieces, again.pieces), "the plan is deterministic"
      rows = data.PackedRows(ids, mask, offsets, plan).rows(range(plan.num_rows))
      _check_rows(rows, plan, seq, mask)
      real = rows["tokens"][rows["segment_ids"] > 0]
      if mode == "split":
        expected = ids
        assert plan.truncated_documents == plan.truncated_tokens == 0
      else:
        expected = np.concatenate([ids[a:a + min(n, seq)] for a, n in zip(offsets, lengths)])
        assert plan.truncated_documents == (lengths > seq).sum(), trial
        assert plan.truncated_tokens == np.maximum(lengths - seq, 0).sum()
      assert np.array_equal(np.sort(real), expected)    # every token exactly once
      assert plan.efficiency == (rows["segment_ids"] > 0).sum() / (plan.num_rows * seq)
      # Best fit opens a row only for a piece no open row fits: no two rows could be one.
      used = np.sort([plan.pieces[a:b, 2].sum()
                      for a, b in zip(plan.row_offsets, plan.row_offsets[1:])])
      assert len(used) < 2 or used[0] + used[1] > seq


def test_best_fit_decreasing_fills_the_fullest_row_that_fits():
  # 6 opens row 0 (room 4), 5 opens row 1 (room 5), 4 fills row 0 (room 4 is the tightest), 3
  # goes to row 1 (room 2), the first 2 fills it, the second 2 opens row 2.
  order, rows = data.packing.best_fit_decreasing(np.array([2, 4, 6, 3, 5, 2]), 10)
  assert order.tolist() == [2, 4, 1, 3, 0, 5]
  assert rows.tolist() == [1, 0, 0, 1, 1, 2]


# The cache.

def _corpus_files(tmp_path):
  _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in CORPUS[:4]] + [
      {"prompt": "2+2=", "completion": "4"}, {"messages": CHAT}])
  (tmp_path / "notes.txt").write_text(" ".join(CORPUS))
  return [tmp_path / "train.jsonl", tmp_path / "notes.txt"]


def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, hf_tokenizer,
                                                              monkeypatch):
  files = _corpus_files(tmp_path)
  first = data.prepare(files, hf_tokenizer, tmp_path / "cache", seq=32, batch_size=2)
  cache_dir = first.report.cache
  assert not first.report.reused
  assert first.report.kinds == {"text": 5, "prompt_completion": 1, "chat": 1}
  ids_file = Path(cache_dir) / "ids.npy"
  stamp = os.stat(ids_file).st_mtime_ns
  cached = np.load(ids_file, mmap_mode="r")
  assert isinstance(cached, np.memmap) and cached.dtype == np.int32
  meta = json.loads((Path(cache_dir) / "meta.json").read_text())
  assert len(cached) == meta["tokens"] and meta["documents"] == 7

  def no_tokenizing(*args, **kwargs):
    raise AssertionError("the cache was rebuilt")

  monkeypatch.setattr(cache_module, "Encoder", no_tokenizing)
  second = data.prepare(files, hf_tokenizer, tmp_path / "cache", seq=32, batch_size=2)
  assert second.report.reused and second.report.cache == cache_dir
  assert os.stat(ids_file).st_mtime_ns == stamp
  assert second.train.fingerprint == first.train.fingerprint
  assert np.array_equal(second.train.batch_at(3)["tokens"], first.train.batch_at(3)["tokens"])
  monkeypatch.undo()

  with open(files[0], "a") as f:
    f.write(json.dumps({"text": "one more document"}) + "\n")
  changed = data.prepare(files, hf_tokenizer, tmp_path / "cache", seq=32, batch_size=2)
  assert not changed.report.reused and changed.report.cache != cache_dir
  assert changed.report.kinds["text"] == 6
  assert changed.train.fingerprint != first.train.fingerprint
  with pytest.raises(data.DataError, match="resume with the same data"):
    changed.train.check_resume(first.train.fingerprint)
  key = {"text_field": "text", "loss_on": "completion"}
  fingerprint = data.data_fingerprint(files, hf_tokenizer, **key)
  assert changed.report.cache.endswith(fingerprint)
  assert fingerprint != data.data_fingerprint(files, data.ByteTokenizer(), **key)
  assert fingerprint != data.data_fingerprint(files, hf_tokenizer, **{**key, "loss_on": "all"})
  assert fingerprint != data.data_fingerprint(files, hf_tokenizer, **{**key, "text_field": "b"})


def test_the_cache_holds_what_the_encoder_gives_written_in_chunks(tmp_path, hf_tokenizer,
                                                                  monkeypatch):
  files = _corpus_files(tmp_path)
  monkeypatch.setattr(cache_module, "CHUNK_TOKENS", 3)
  cache = data.build_cache(files, hf_tokenizer, tmp_path / "cache")
  encoded = [data.encode_record(r, hf_tokenizer) for r in data.read_records(files)]
  assert cache.num_documents == len(encoded) == cache.meta["documents"]
  for d, (ids, mask) in enumerate(encoded):
    a, b = cache.offsets[d], cache.offsets[d + 1]
    assert cache.ids[a:b].tolist() == ids.tolist() and cache.mask[a:b].tolist() == mask.tolist()
  assert cache.offsets.dtype == np.int64 and cache.mask.dtype == np.uint8


def test_an_interrupted_build_leaves_no_cache(tmp_path, hf_tokenizer, monkeypatch):
  files = _corpus_files(tmp_path)
  monkeypatch.setattr(cache_module, "CHUNK_TOKENS", 4)    # chunks are on disk when it fails
  real_encoder = cache_module.Encoder

  class FailingEncoder(real_encoder):
    calls = 0

    def __call__(self, record):
      FailingEncoder.calls += 1
      if FailingEncoder.calls == 4:
        raise KeyboardInterrupt
      return super().__call__(record)

  monkeypatch.setattr(cache_module, "Encoder", FailingEncoder)
  with pytest.raises(KeyboardInterrupt):
    data.prepare(files, hf_tokenizer, tmp_path / "cache", seq=16, batch_size=2)
  assert FailingEncoder.calls == 4
  assert list((tmp_path / "cache").iterdir()) == []
  monkeypatch.undo()
  prepared = data.prepare(files, hf_tokenizer, tmp_path / "cache", seq=16, batch_size=2)
  assert not prepared.report.reused and prepared.train.num_rows > 0


# Batches.

def _packed(num_docs=23, seq=8, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 2 * seq, size=num_docs)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  ids = np.arange(offsets[-1], dtype=np.int32)
  plan = data.plan_packing(lengths, seq, long_documents="split")
  return data.PackedRows(ids, np.ones(len(ids), np.uint8), offsets, plan, fingerprint="p")


def test_batch_at_is_deterministic_and_covers_every_row_once_an_epoch():
  packed = _packed()
  n, b = packed.num_rows, 4
  assert n % b, "batches straddle epochs"
  batches = data.Batches(packed, b, seed=3)
  again = data.Batches(_packed(), b, seed=3)
  for step in (0, 7, 1000):
    one, two = batches.batch_at(step), again.batch_at(step)
    assert all(np.array_equal(one[k], two[k]) for k in data.packing.ROW_FIELDS)
    assert all(v.shape == (b, packed.seq) and v.dtype == np.int32 for v in one.values())
  steps = -(-3 * n // b)
  order = np.concatenate([batches.indices(s) for s in range(steps)])
  epochs = [order[e * n:(e + 1) * n] for e in range(3)]
  for epoch in epochs:
    assert sorted(epoch.tolist()) == list(range(n))
  assert not np.array_equal(epochs[0], epochs[1]), "each epoch is reshuffled"
  assert not np.array_equal(data.Batches(packed, b, seed=4).indices(0), batches.indices(0))
  assert batches.fingerprint == again.fingerprint
  assert batches.fingerprint != data.Batches(packed, b, seed=4).fingerprint
  assert batches.fingerprint != data.Batches(packed, b + 1, seed=3).fingerprint
  batches.check_resume(again.fingerprint)
  assert np.array_equal(batches.batch_at(5)["tokens"], packed.rows(batches.indices(5))["tokens"])


def test_rows_of_a_step_equal_the_slice_of_its_batch():
  batches = data.Batches(_packed(), 5, seed=1)
  for step in (0, 3, 11):
    whole = batches.batch_at(step)
    for lo, hi in ((0, 5), (0, 2), (2, 5), (1, 4), (3, 3)):
      part = batches.rows(step, lo, hi)
      for name in data.packing.ROW_FIELDS:
        assert np.array_equal(part[name], whole[name][lo:hi])
  with pytest.raises(ValueError, match=r"0 <= lo <= hi <= batch_size \(5\), got lo=2, hi=6"):
    batches.rows(0, 2, 6)


def test_held_out_evaluation_in_order(tmp_path):
  rows = [{"text": f"document number {i} " + "x" * (i % 7)} for i in range(40)]
  path = _write_jsonl(tmp_path / "d.jsonl", rows)
  prepared = data.prepare(path, None, tmp_path / "cache", seq=32, batch_size=3, eval_share=0.25,
                          seed=5)
  report = prepared.report
  assert (report.train_documents, report.eval_documents) == (30, 10)
  train_docs, eval_docs = data.held_out_documents(40, 0.25, seed=5)
  assert len(np.intersect1d(train_docs, eval_docs)) == 0 and len(train_docs) + len(eval_docs) == 40
  evaluation = prepared.eval
  texts = set()
  for k, batch in enumerate(evaluation):
    assert np.array_equal(batch["tokens"], evaluation.batch_at(k)["tokens"])
    for r in range(3):
      row = k * 3 + r
      if row < evaluation.num_rows:
        assert np.array_equal(batch["tokens"][r], evaluation.packed.row(row)["tokens"])
      else:
        assert (batch["segment_ids"][r] == 0).all() and (batch["targets"][r] == -100).all()
      for s in range(1, batch["segment_ids"][r].max() + 1):
        texts.add(bytes(batch["tokens"][r][batch["segment_ids"][r] == s].astype(np.uint8)))
  assert texts == {rows[d]["text"].encode() for d in eval_docs}
  assert len(evaluation) == -(-evaluation.num_rows // 3)
  assert np.array_equal(evaluation.rows(1, 1, 3)["tokens"], evaluation.batch_at(1)["tokens"][1:])


def test_evaluation_files_and_long_documents(tmp_path):
  train = _write_jsonl(tmp_path / "train.jsonl", [{"text": "a" * 50}, {"text": "b" * 5}])
  held = _write_jsonl(tmp_path / "eval.jsonl", [{"text": "c" * 7}, {"text": "d" * 9}])
  truncated = data.prepare(train, None, tmp_path / "cache", seq=16, batch_size=2,
                           eval_paths=held, long_documents="truncate")
  assert (truncated.train.truncated, truncated.report.truncated_tokens) == (1, 34)
  assert truncated.train.num_tokens == 16 + 5
  assert truncated.eval.num_rows == 1 and truncated.eval.num_tokens == 16
  assert truncated.report.eval_documents == 2
  split = data.prepare(train, None, tmp_path / "cache", seq=16, batch_size=2)
  assert split.train.truncated == 0 and split.train.num_tokens == 55   # auto: text is split
  assert split.train.num_rows == 4 and split.train.efficiency == 55 / 64
  assert split.report.cache == truncated.report.cache     # one cache, two packing plans
  sft = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p" * 20, "completion": "c"}])
  assert data.prepare(sft, None, tmp_path / "cache", seq=16, batch_size=1).train.truncated == 1
  with pytest.raises(ValueError, match="long_documents must be 'auto' or one of"):
    data.prepare(train, None, tmp_path / "cache", seq=16, batch_size=2, long_documents="drop")
  with pytest.raises(ValueError, match="eval_paths or eval_share, not both"):
    data.prepare(train, None, tmp_path / "cache", seq=16, batch_size=2, eval_paths=held,
                 eval_share=0.5)

"""`model.init_from` of a Hugging Face directory that holds its tokenizer.json: the run's data must be token
shards made with that tokenizer (compared by the file's SHA-256 in each shard set's manifest), checked before any
device work; byte-tokenized sources and shards of another tokenizer are refused with the command that fixes it."""

from __future__ import annotations

import os
import shutil

import pytest
from hf_helpers import UNTIED
from tokenize_helpers import STDLIB_FILES, stdlib_path, train_hf_bpe

from jaxpar.config import ConfigError, load_config
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.training.init_from import check_init_from_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from_tokenizer")
    hf = root / "hf"
    shutil.copytree(UNTIED, hf)
    train_hf_bpe(str(hf / "tokenizer.json"))
    inputs = tuple(stdlib_path(n) for n in STDLIB_FILES)
    for name, tokenizer in (("own", str(hf)), ("other", train_hf_bpe(str(root / "other.json"))), ("bytes", "byte")):
        if name == "other":  # another tokenizer.json: the same trainer on other text would do; change one merge
            text = open(tokenizer).read().replace('"</s>"', '"</S>"')
            open(tokenizer, "w").write(text)
        tokenize_corpus(
            TokenizeOptions(inputs=inputs, out=str(root / name), tokenizer=tokenizer, workers=1, progress=False)
        )
    return root


def _cfg(env, *overrides):
    args = [f"model.init_from={env / 'hf'}", *overrides]
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), args, validate=False)


def test_shards_of_the_directory_tokenizer_pass(env):
    check_init_from_tokenizer(_cfg(env, "data.source=shards", f"data.path={env / 'own'}"))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("data.source=stdlib",), r"holds the tokenizer its weights were trained with, but data is source='stdlib'"),
        (("data.source=shards", "data.path=SET:other"), r"was made with another tokenizer than model.init_from"),
        (("data.source=shards", "data.path=SET:bytes"), r"was made with another tokenizer than model.init_from"),
        (("data.source=shards", "data.path=SET:own", "data.validation_path=SET:bytes"), r"another tokenizer"),
    ],
    ids=["stdlib", "other_tokenizer", "byte_shards", "validation_set"],
)
def test_data_of_another_tokenizer_is_refused_with_the_fix(env, overrides, match):
    overrides = [o.replace("SET:", f"{env}/") for o in overrides]
    with pytest.raises(ConfigError, match=match) as e:
        check_init_from_tokenizer(_cfg(env, *overrides))
    assert f"jaxpar-data tokenize INPUT --tokenizer {env / 'hf'} --out DIR" in str(e.value)


def test_a_directory_without_tokenizer_json_is_not_checked():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"model.init_from={UNTIED}"], validate=False)
    check_init_from_tokenizer(cfg)  # the fixture has no tokenizer.json: byte data is the user's choice

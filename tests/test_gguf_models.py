"""`--model` with what users have: GGUF files of each supported family and quantisation
(written here with the `gguf` package), against transformers reading the same file; the
file's own 4-bit blocks as the int4 decode weights; hub ids in the local Hugging Face cache;
refusals that name what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_gguf import VOCAB, write_tiny_gguf
from tiny_models import make_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ragkv.engine.fingerprint import model_fingerprint
from ragkv.engine.gguf_file import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from ragkv.engine.linear import Int4Kernel
from ragkv.engine.model import CausalLM
from ragkv.engine.model_files import INT4_BLOCKS_FILE, SOURCE_FILE, resolve_model_dir, served_name
from ragkv.engine.numerics import Numerics

CASES = [
    ("llama", "F32"),
    ("llama", "F16"),
    ("llama", "BF16"),
    ("llama", "Q8_0"),
    ("llama", "Q4_0"),
    ("llama", "Q4_1"),
    ("mistral", "Q4_0"),
    ("qwen2", "Q4_1"),
    ("qwen2", "F16"),
    ("qwen3", "Q8_0"),
    ("qwen3", "Q4_0"),
    ("llama", "Q4_K"),
    ("qwen2", "Q6_K"),
    ("qwen3", "Q5_K"),
]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGKV_CACHE", str(tmp_path_factory.mktemp("ragkv-cache")))
        patch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _gguf(files: Path, family: str, kind: str) -> Path:
    path = files / f"tiny-{family}-{kind}.gguf"
    # llama.cpp writes Mistral as architecture "llama"; transformers reads such a file as Llama
    # (same layers: Mistral's sliding window is absent from the file)
    name = "Mistral Tiny Instruct" if family == "mistral" else f"tiny-{family}"
    hidden = 256 if kind in K_QUANTS else None  # K-quant rows are whole 256-weight super-blocks
    return path if path.is_file() else write_tiny_gguf(family, path, kind, name=name, hidden_size=hidden)


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("family", "kind"), CASES)
@pytest.mark.model
def test_gguf_prefill_and_decode_match_transformers_on_the_same_file(files, family, kind):
    path = _gguf(files, family, kind)
    model_dir = resolve_model_dir(str(path))
    assert kind in json.loads((model_dir / SOURCE_FILE).read_text())["tensor_types"]
    ours = CausalLM.load(model_dir)
    assert ours.spec.family == ("llama" if family == "mistral" else family)
    # the config as ragkv read it: transformers takes Qwen3's head dimension from its own
    # default (128, every released Qwen3's) instead of the file's attention.key_length
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, config=AutoConfig.from_pretrained(model_dir)
    ).eval()
    tokens = _prompt(40)
    cache = ours.new_cache(64)
    logits = ours.prefill(tokens, cache)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(tokens[None]).logits[0, -1], atol=1e-4, rtol=1e-4)
        theirs = reference.generate(
            tokens[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 40:].tolist()
    generated = []
    for _ in range(12):
        generated.append(int(logits.argmax()))
        logits = ours.decode_step(generated[-1], cache)
    assert generated == theirs


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.model
def test_int4_decode_weights_are_the_files_own_blocks(files, kind):
    """Every layer's int4 decode kernel holds exactly the weights transformers dequantises
    from the file; for Q4_0 (codes -8..7 around zero) rounding those weights again by each
    group's minimum and maximum would change them."""
    path = _gguf(files, "llama", kind)
    model_dir = resolve_model_dir(str(path))
    blocks = load_file(str(model_dir / INT4_BLOCKS_FILE))
    assert len(blocks) == 7 * 3 + 2  # seven matrices per layer, the embedding and the LM head
    numerics = Numerics(weights="int4")
    model = CausalLM.load(model_dir, numerics=numerics)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = reference.state_dict()
    requantised_differs = False
    for i, layer in enumerate(model.weights.layers):
        p = f"model.layers.{i}."
        expected = {
            "qkv": torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "o_proj": state[p + "self_attn.o_proj.weight"],
            "gate_up": torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]),
            "down": state[p + "mlp.down_proj.weight"],
        }
        for name, weight in expected.items():
            kernel = getattr(layer, name).few_rows
            assert isinstance(kernel, Int4Kernel)
            assert torch.equal(kernel.dequantized(), weight)
            requantised_differs |= not torch.equal(Int4Kernel(weight).dequantized(), weight)
    assert requantised_differs == (kind == "Q4_0")


@pytest.mark.model
def test_the_file_carries_chat_template_special_tokens_and_context(files):
    path = _gguf(files, "qwen2", "Q4_1")
    model_dir = resolve_model_dir(str(path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == VOCAB
    model = CausalLM.load(model_dir)
    assert model.spec.rope.max_position_embeddings == 512 and model.spec.eos_token_ids == (2,)


@pytest.mark.model
def test_fingerprint_separates_files_and_keeps_one_files_value(files, tmp_path):
    numerics = Numerics()

    def fingerprint(path: Path) -> str:
        model_dir = resolve_model_dir(str(path))
        model = CausalLM.load(model_dir)
        return model_fingerprint(model_dir, model.spec, "float16", [1, 2], numerics)

    first = fingerprint(_gguf(files, "llama", "Q4_0"))
    assert fingerprint(_gguf(files, "llama", "Q4_0")) == first
    assert fingerprint(_gguf(files, "llama", "Q4_1")) != first  # same model, other quantisation
    other_seed = write_tiny_gguf("llama", tmp_path / "seed.gguf", "Q4_0", seed=5, name="tiny-llama")
    assert fingerprint(other_seed) != first


@pytest.mark.model
def test_unsupported_architecture_is_refused_by_name(files):
    path = write_tiny_gguf("llama", files / "phi.gguf", "F16", architecture="phi3")
    with pytest.raises(UnsupportedModelError) as refused:
        resolve_model_dir(str(path))
    message = str(refused.value)
    assert "'phi3'" in message and all(name in message for name in SUPPORTED_ARCHITECTURES)


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_dir(str(bogus))


def _hub_snapshot(org: str, name: str, revision: str = "0123abcd") -> Path:
    import os

    repo = Path(os.environ["HF_HOME"]) / "hub" / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


@pytest.mark.model
def test_hub_ids_resolve_from_the_local_cache_only(files):
    folder = make_tiny_model("qwen3", _hub_snapshot("tiny-org", "tiny-qwen3"))
    assert resolve_model_dir("tiny-org/tiny-qwen3") == folder
    assert served_name(folder) == "tiny-org/tiny-qwen3"  # not the snapshot's revision hash
    snapshot = _hub_snapshot("tiny-org", "tiny-llama-gguf")
    (snapshot / "tiny.Q4_1.gguf").write_bytes(_gguf(files, "llama", "Q4_1").read_bytes())
    model_dir = resolve_model_dir("tiny-org/tiny-llama-gguf")
    assert CausalLM.load(model_dir).spec.family == "llama"
    assert resolve_model_dir("tiny-org/tiny-llama-gguf/tiny.Q4_1.gguf") == model_dir
    with pytest.raises(FileNotFoundError) as missing:
        resolve_model_dir("tiny-org/absent-model")
    assert "models--tiny-org--absent-model" in str(missing.value) and "local Hugging Face cache" in str(missing.value)


def test_a_folder_of_an_unsupported_model_type_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    with pytest.raises(UnsupportedModelError, match="model type 'phi3' is not supported; ragkv runs llama"):
        resolve_model_dir(str(tmp_path))

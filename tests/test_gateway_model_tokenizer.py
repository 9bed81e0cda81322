"""A converted checkpoint brings its own tokenizer: the converter copies the files, the gateway uses
them, and falls back to the packaged DeepSeek-V3 tokenizer when a model directory has none."""
import json

from model.convert import convert
from model.grammar import default_tokenizer_json
from model.tokenizer_files import TOKENIZER_FILES, model_tokenizer_json
from services.gateway.config import GatewayConfig
from services.gateway.gateway_state import GatewayState
from services.gateway.tokenizer import DEFAULT_TOKENIZER_JSON
from tests.hf_checkpoint import save_small_v3_checkpoint

MARKER = "<｜test▁marker｜>"


def _checkpoint_with_tokenizer(hf_dir):
    save_small_v3_checkpoint(hf_dir)
    # The checkpoint's own tokenizer: the V3 vocabulary with one more added token, so it is told apart.
    spec = json.loads(DEFAULT_TOKENIZER_JSON.read_text(encoding="utf-8"))
    vocab = max(token["id"] for token in spec["added_tokens"]) + 1
    spec["added_tokens"].append({"id": vocab, "content": MARKER, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ bos_token }}"}))
    return vocab + 1


def test_converted_model_brings_its_tokenizer_and_the_gateway_uses_it(tmp_path):
    vocab = _checkpoint_with_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "model", progress=False)
    copied = tmp_path / "model"
    assert sorted(p.name for p in copied.iterdir() if p.name in TOKENIZER_FILES) == [
        "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((copied / "tokenizer_config.json").read_text())["chat_template"] == "{{ bos_token }}"
    # The gateway's tokenizer and the engine's grammar masks read the same file.
    assert model_tokenizer_json(copied) == default_tokenizer_json(copied) == copied / "tokenizer.json"

    state = GatewayState.build(GatewayConfig(model_dir=str(tmp_path / "model"), redis_url=""))
    assert state.tokenizer.vocab_size == vocab
    assert state.tokenizer.piece_bytes(vocab - 1) == MARKER.encode()

    # A model directory without tokenizer files (a preset): the packaged V3 tokenizer.
    (tmp_path / "preset").mkdir()
    assert model_tokenizer_json(tmp_path / "preset") is None
    fallback = GatewayState.build(GatewayConfig(model_dir=str(tmp_path / "preset"), redis_url=""))
    assert fallback.tokenizer.vocab_size == vocab - 1

"""A tiny Llama with random weights and its tokenizer, built locally in seconds (no download).

Tests, benchmarks and ``hisparse demo --vllm`` run vLLM's real CPU engine on
it: 4 layers, hidden 256, 2 KV heads, vocab 2048, bf16. The weights are
drawn from a fixed seed, so every build of one ``TinyModel`` is the same
model, byte for byte, and greedy decoding is deterministic. The tokenizer is
a byte-level BPE trained on generated text, so any prompt tokenizes; the
chat template is a plain one for ``vllm serve``'s chat endpoint.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_SPECIAL = ["<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_WORDS = ("the cache page block token engine daemon prefix layer region host memory shared "
          "node request model store load pin commit reserve evict turn chat answer question "
          "hisparse vllm tier first second third alpha beta gamma delta").split()


@dataclass(frozen=True)
class TinyModel:
    """The model's shape; the defaults are the tests' model."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 8192
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, bf16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def build(self, path: str | os.PathLike[str]) -> Path:
        """Write config, weights and tokenizer under ``path`` (once: a second call reuses them)."""
        out = Path(path)
        stamp = out / "tiny-model.json"
        if stamp.exists() and json.loads(stamp.read_text()) == asdict(self):
            return out
        out.mkdir(parents=True, exist_ok=True)
        self._write_config(out)
        self._write_weights(out)
        _write_tokenizer(out, self.vocab_size)
        stamp.write_text(json.dumps(asdict(self)))
        return out

    def _write_config(self, out: Path) -> None:
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": self.num_layers,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1,
        }
        (out / "config.json").write_text(json.dumps(config, indent=1))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))

    def _write_weights(self, out: Path) -> None:
        import torch
        from safetensors.torch import save_file

        gen = torch.Generator().manual_seed(self.seed)
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        kv = self.num_kv_heads * d

        def rand(*shape: int) -> torch.Tensor:
            # std well above the usual 0.02: logits vary enough that greedy output is not one token
            return (torch.randn(*shape, generator=gen) * 0.08).to(torch.bfloat16)

        weights = {"model.embed_tokens.weight": rand(self.vocab_size, h),
                   "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                   "lm_head.weight": rand(self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            weights.update({
                p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            })
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(2)
    # Made-up words besides the prompt words, so the merges fill the whole vocabulary:
    # every id the model can emit then decodes.
    made_up = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9)))
                        for _ in range(50)) for _ in range(4000)]
    tok.train_from_iterator(sample_texts(2000) + made_up, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
              "eos_token": "<|eos|>", "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def sample_texts(n: int, seed: int = 1, words: int = 40) -> list[str]:
    """``n`` lines of ``words`` words, the same for one seed: training text and test prompts."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(words)) for _ in range(n)]

"""Build a tiny random-weight Llama (0.4 M parameters, 2.2 MB) that vLLM loads from disk.

Usage: python make_tiny.py OUT_DIR        (run in the vLLM venv: needs transformers, tokenizers)

Deterministic (seeded), no download. Shapes fit the CPU attention backend: head_dim 32, GQA
(4 heads, 2 KV heads), 2 layers, fp32. Weights ~ N(0, 0.05): varied greedy output, no argmax
near-ties (shared/research/vllm-cpu.md §2).
"""

from __future__ import annotations

import os
import sys
import tempfile


def main(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    sentences = [
        "the prefill instance computes the prompt's key value cache",
        "relay decode streams the first tokens while the cache crosses the wide area network",
        "main decode receives the cache and takes the request over from relay decode",
        "token ids travel on the control lane and never wait behind gigabytes of cache",
        "every chunk is checked with a hash before it is acknowledged",
        "a quick brown fox jumps over the lazy dog 0123456789",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=444, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sentences, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    vocab = len(fast)

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.fill_(1.0)
            else:
                prm.normal_(0.0, 0.05)
    # Build next to OUT and rename: a half-written model is never mistaken for a built one.
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    if os.path.isdir(out):
        import shutil

        shutil.rmtree(out)
    os.rename(tmp, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny llama: {n} parameters, vocab {vocab}, in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

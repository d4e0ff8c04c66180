"""A `tokenizers` tokenizer for a GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama").

A GGUF carries no tokenizer.json: only the pieces, their scores and token types. Gemma's file
lists no merges either, so they are rebuilt from the vocabulary the way transformers' GGUF
loader does (integrations/gguf/gguf_tokenizer_mapping.py gemma_tokenizer + GemmaTokenizer), so
the two tokenize alike: a BPE over "▁"-for-space pieces with byte fallback (<0xXX> tokens),
control tokens kept whole as special tokens, user-defined ones kept whole as added tokens.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def respell(tokens: Sequence[str]) -> list[str]:
    """Gemma's GGUF stores its pieces of two or more spaces as real spaces ("  "); the model
    looks text up after spaces became "▁", so spell those pieces that way."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def merges_by_position(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Every split of each piece into two pieces of the vocabulary, best first. Gemma's scores do
    not follow its merge order; the order the pieces appear in the file does (earlier = merged
    first). Ties (one piece, several splits) go longer left piece first, then by the pieces' ids:
    transformers' generate_merges order, which this must reproduce to tokenize alike."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[int, int, int, str, str]] = []
    for piece, index in vocab.items():
        local = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort(key=lambda x: (x[0], x[1]))
        found.extend((index, len(left), len(right), left, right) for _, _, left, right in local)
    # generate_merges sorts (-index, len(left), len(right)) descending with a stable sort: the
    # same as ascending index, then descending lengths, keeping the id order within equal keys.
    order = sorted(range(len(found)), key=lambda k: (found[k][0], -found[k][1], -found[k][2]))
    return [(found[k][3], found[k][4]) for k in order]


def build_sentencepiece_bpe(tokens: Sequence[str], token_types: Sequence[int], unk_token: str,
                            merges: Sequence[str] | None = None) -> Tokenizer:
    """Gemma's tokenizer: spaces normalized to "▁" (no prefix space added), BPE with byte
    fallback, decoded back through "▁" -> " " and the byte tokens fused into UTF-8. `merges`:
    the file's own ("left right" each), where it has them; else rebuilt from the vocabulary."""
    pieces = respell(tokens)
    vocab = {t: i for i, t in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError("tokenizer.ggml.tokens: the vocabulary spells a piece twice")
    pairs = ([(left, right) for left, _, right in (m.partition(" ") for m in merges)] if merges is not None
             else merges_by_position(pieces))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    # Splits on a space the normalizer has already replaced: a no-op kept for parity with
    # GemmaTokenizer's tokenizer.json.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = list(token_types)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(pieces, types) if ty == CONTROL or t == unk_token])
    # llama.cpp matches user-defined pieces (e.g. "\n\n", "<h1>") whole, wherever they appear;
    # the respelled space runs are left to the merges (as transformers does: it looks their file
    # spelling up in the respelled vocabulary and does not find it)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, orig, ty in zip(pieces, tokens, types) if ty == USER_DEFINED and t == orig])
    return tok

"""Pieces of the services' OpenAPI documents that more than one service states the same way."""
from __future__ import annotations


def token_id_pattern(vocab_size: int) -> str:
    """A regex of the decimal numbers 0 .. vocab_size - 1 without leading zeros: token ids written as
    JSON object keys (logit_bias), so that a schema-valid key is one the service accepts."""
    digits = str(vocab_size - 1)
    options = ["0"] + [f"[1-9][0-9]{{{k - 1}}}" for k in range(1, len(digits))]  # shorter numbers
    for i, digit in enumerate(digits):  # same length: equal up to i, then a smaller digit
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            options.append(f"{digits[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(digits) - i - 1}}}")
    options.append(digits)
    return "^(" + "|".join(options) + ")$"

"""Weight-only quantization: the formats (nf4, fp4, int8) and the frozen QuantizedLinear the
quantize_linears pass swaps in (torch only)."""

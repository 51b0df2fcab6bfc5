"""Model runner: the Llama-family forward pass, its weights, RoPE and the attention-backend seam."""

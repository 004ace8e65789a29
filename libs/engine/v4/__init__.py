"""The DeepSeek-V4 family (``model_type: deepseek_v4``): config and the reference model."""

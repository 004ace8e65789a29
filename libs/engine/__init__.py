"""deepserve's engine library for the DeepSeek-V3 model family.

Import the pieces from their modules (``libs.engine.engine``, ``libs.engine.llm``...); this
package itself imports nothing heavy so policy code (scheduler, block manager) stays free of
torch.
"""

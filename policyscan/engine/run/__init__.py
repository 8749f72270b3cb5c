"""A run: prompts packed into batches, the Engine that scores them, and the pipeline from inputs to outputs."""

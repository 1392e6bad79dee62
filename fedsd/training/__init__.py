"""The one DP training loop (loop) and central training (central), physical batches,
seeds, callbacks, TensorBoard logs and what a finished run says (summary)."""

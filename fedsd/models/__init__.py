"""The networks (networks), weights from a file and what is trained (pretrained), and a
released model loaded back (released)."""

"""Data sets (datasets), a data holder's own files (client_data) and features computed once
per data set: ScatterNet's and a frozen pretrained backbone's (features)."""

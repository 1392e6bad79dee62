"""The commands a user runs (`fedsd train|simulate|split-data|sweep|audit|ledger|check-privacy`)."""

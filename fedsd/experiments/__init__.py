"""The drivers that make this repository's own result tables (`fedsd reproduce`): not part of the product."""

"""The studies that make this repository's results/ (`fedsd reproduce`, and the scripts beside
them): Ray-backed federated simulations and central reproductions of the papers, run from a
checkout. Not part of the installed package nor of the app bundle (simulations/README.md)."""

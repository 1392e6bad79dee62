"""The local-deployment harness behind scripts/deploy-local.sh: a SuperLink and SuperNodes on this machine."""

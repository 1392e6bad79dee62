"""`server` moved into the one package `fedsd` (fedsd 0.2, docs/architecture.md).

Not installed: this folder only answers an old import from a checkout with the new place."""
_MOVED = """
    server                                        -> fedsd.app.server
    server.app                                    -> fedsd.app.server.server_app
    server.checkpoint                             -> fedsd.app.server.checkpoint
    server.grid                                   -> fedsd.app.server.grid
    server.rounds                                 -> fedsd.app.server.rounds
    server.secure_aggregation                     -> fedsd.app.server.secure_rounds
    server.strategy                               -> fedsd.app.server.strategy
"""
raise ImportError("`server` is now `fedsd.app.server`: every module of it moved into the package fedsd. Old name -> new name:"
                  + _MOVED + "(docs/architecture.md)")

"""The wire contract: every served model's request and response tensors (`contract`), said once.

Its own room because three products read it and none may import the others' code: the engines'
request validation (`backend/prompt.py`), the Triton layer (the stubs and the repository renderer in
`serving/`) and the torch-free gateway and client (`gateway/`). Imports nothing of tandem.
"""

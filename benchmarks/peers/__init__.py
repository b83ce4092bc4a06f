"""The peers the benchmarks measure this server against, each started isolated beside it on a shared
machine.

``stock_stack``       MMS 1.1.11 + sagemaker-inference 1.10.1 + the AWS PyTorch handler 1.5.1, in
                      .bench-venv/
``torchserve_stack``  TorchServe 0.12 with its own dynamic batching, in .torchserve-venv/

Each lives in a virtual environment of its own (never the project's), created on first use.
"""

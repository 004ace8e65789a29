"""The balancer: picks a prefill and a decode instance for each request (see main.py)."""

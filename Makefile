.PHONY: book test bench
book:
	bash .ci/book
test:
	bash .ci/test
bench:
	.venv/bin/python -m packed_kernels.bench all

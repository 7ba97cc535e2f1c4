source /work/wt-torchwin/.venv/bin/activate; cd /work/wt-torchwin/benchmarks
for i in 1 2 3 4 5 6; do
  echo "new $(python torch_protect.py --null --rounds 9 | grep -E '^(global|thread_local|relaxed):' | sed -E 's/^([a-z_]+): protected ([0-9.]+) us vs unprotected ([0-9.]+) us.*\+([0-9.]+) us, \+([0-9]+) Python calls/\1 \2 \3 \4 \5/' | tr '\n' ' ')"
  echo "old $(PYTHONPATH=/tmp/torchwin_base python torch_protect.py --null --rounds 9 | grep -E '^(global|thread_local|relaxed):' | sed -E 's/^([a-z_]+): protected ([0-9.]+) us vs unprotected ([0-9.]+) us.*\+([0-9.]+) us, \+([0-9]+) Python calls/\1 \2 \3 \4 \5/' | tr '\n' ' ')"
done

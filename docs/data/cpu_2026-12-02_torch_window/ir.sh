ir() { PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null python /tmp/ir.py $1 $2 2>&1 | grep "I *refs" | awk '{gsub(",","",$4); print $4}'; }
per() { a=$(ir $1 0); b=$(ir $1 2000); echo $(( (b-a)/2000 )); }
p=$(per plain); n=$(per protected); o=$(PYTHONPATH=/tmp/torchwin_base per protected)
echo "instructions per capture: plain $p, protected new $n (+$((n-p))), protected old $o (+$((o-p)))"

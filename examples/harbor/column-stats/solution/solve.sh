#!/bin/bash
cat > /app/stats.sh <<'SH'
#!/bin/bash
datamash -t, sum 2 mean 2 max 2 < "$1" | tr ',' '\n'
SH
chmod +x /app/stats.sh
/app/stats.sh /app/data/prices.csv

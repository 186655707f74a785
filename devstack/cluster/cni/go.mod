module gpushare.local/cni/loopback

go 1.22

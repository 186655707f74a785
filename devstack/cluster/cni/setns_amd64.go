package main

// sysSetns is setns(2)'s number on amd64 (Go's syscall package does not name it).
const sysSetns = 308

//! SQL92-style filters over record properties, as RocketMQ's `MessageSelector.bySql`:
//! comparisons (`=`, `<>`, `!=`, `<`, `<=`, `>`, `>=`), `AND`, `OR`, `NOT`, parentheses,
//! `IN (...)`, `BETWEEN ... AND ...`, `IS [NOT] NULL`, string literals in single quotes,
//! numbers, `TRUE` and `FALSE`.
//!
//! Parsed with the `sqlparser` crate, then compiled into a small tree of our own, so a
//! construct the evaluator does not support is refused at subscribe time (naming it)
//! rather than silently matching nothing. Properties are strings; a comparison with a
//! number compares numerically (a property that is not a number compares as unknown);
//! ordering comparisons need a number on one side. A missing property makes its
//! comparison unknown, SQL's three-valued logic applies, and a record matches only when
//! the whole expression is true.

use sqlparser::ast::{BinaryOperator, Expr, UnaryOperator, Value};
use sqlparser::dialect::GenericDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::Token;

use super::{FilterError, EXPRESSION_BYTES_MAX};

/// How deep an expression may nest (the parser's own guard against stack exhaustion).
const NESTING_MAX: usize = 32;

/// A compiled SQL filter.
#[derive(Debug, Clone, PartialEq)]
pub struct SqlFilter {
    root: Node,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Not(Box<Node>),
    Compare(Operand, Op, Operand),
    In {
        name: String,
        list: Vec<String>,
        negated: bool,
    },
    Between {
        operand: Operand,
        low: f64,
        high: f64,
        negated: bool,
    },
    IsNull {
        name: String,
        negated: bool,
    },
    Constant(bool),
}

#[derive(Debug, Clone, PartialEq)]
enum Operand {
    Property(String),
    Text(String),
    Number(f64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Op {
    fn ordering(self) -> bool {
        matches!(self, Op::Lt | Op::Le | Op::Gt | Op::Ge)
    }

    fn holds(self, ordering: std::cmp::Ordering) -> bool {
        use std::cmp::Ordering::*;
        match self {
            Op::Eq => ordering == Equal,
            Op::Ne => ordering != Equal,
            Op::Lt => ordering == Less,
            Op::Le => ordering != Greater,
            Op::Gt => ordering == Greater,
            Op::Ge => ordering != Less,
        }
    }
}

const SUPPORTED: &str = "use comparisons (=, <>, <, <=, >, >=), AND, OR, NOT, IN (...), \
    BETWEEN ... AND ..., IS [NOT] NULL, 'strings', numbers, TRUE and FALSE";

fn refuse(what: impl std::fmt::Display, why: &str) -> FilterError {
    FilterError(format!("`{what}` {why}"))
}

impl SqlFilter {
    /// Parses and compiles `text`; a bad expression is refused naming the problem.
    pub fn parse(text: &str) -> Result<Self, FilterError> {
        if text.len() > EXPRESSION_BYTES_MAX {
            return Err(FilterError(format!(
                "the SQL filter is {} bytes; the limit is {EXPRESSION_BYTES_MAX}",
                text.len()
            )));
        }
        if text.trim().is_empty() {
            return Err(FilterError("the SQL filter is empty".into()));
        }
        let dialect = GenericDialect {};
        let mut parser = Parser::new(&dialect)
            .with_recursion_limit(NESTING_MAX)
            .try_with_sql(text)
            .map_err(|e| FilterError(format!("SQL filter: {e}")))?;
        let expr = parser
            .parse_expr()
            .map_err(|e| FilterError(format!("SQL filter: {e}")))?;
        let next = parser.peek_token();
        if next.token != Token::EOF {
            return Err(FilterError(format!(
                "SQL filter: unexpected `{}` at {} after a complete expression",
                next.token, next.span.start
            )));
        }
        Ok(Self {
            root: compile(&expr)?,
        })
    }

    /// Whether a record with these properties passes (`property(name)` is the value of
    /// its property `name`, if it has one).
    pub fn matches<'a>(&self, property: impl Fn(&str) -> Option<&'a str>) -> bool {
        eval(&self.root, &property) == Some(true)
    }
}

fn compile(expr: &Expr) -> Result<Node, FilterError> {
    Ok(match expr {
        Expr::Nested(inner) => compile(inner)?,
        Expr::BinaryOp { left, op, right } => match op {
            BinaryOperator::And => Node::And(Box::new(compile(left)?), Box::new(compile(right)?)),
            BinaryOperator::Or => Node::Or(Box::new(compile(left)?), Box::new(compile(right)?)),
            _ => {
                let op = match op {
                    BinaryOperator::Eq => Op::Eq,
                    BinaryOperator::NotEq => Op::Ne,
                    BinaryOperator::Lt => Op::Lt,
                    BinaryOperator::LtEq => Op::Le,
                    BinaryOperator::Gt => Op::Gt,
                    BinaryOperator::GtEq => Op::Ge,
                    other => return Err(refuse(other, &format!("is not supported: {SUPPORTED}"))),
                };
                let (l, r) = (operand(left)?, operand(right)?);
                if op.ordering()
                    && !matches!(l, Operand::Number(_))
                    && !matches!(r, Operand::Number(_))
                {
                    return Err(refuse(
                        expr,
                        "compares without a number: <, <=, > and >= need a number on one side; strings compare with = and <>",
                    ));
                }
                if !matches!(l, Operand::Property(_)) && !matches!(r, Operand::Property(_)) {
                    return Err(refuse(
                        expr,
                        "compares two literals: name a property on one side",
                    ));
                }
                Node::Compare(l, op, r)
            }
        },
        Expr::UnaryOp {
            op: UnaryOperator::Not,
            expr,
        } => Node::Not(Box::new(compile(expr)?)),
        Expr::InList {
            expr: inner,
            list,
            negated,
        } => {
            let Operand::Property(name) = operand(inner)? else {
                return Err(refuse(inner, "must be a property name before IN"));
            };
            let list = list
                .iter()
                .map(|e| match operand(e)? {
                    Operand::Text(s) => Ok(s),
                    _ => Err(refuse(e, "must be a 'string' in an IN list")),
                })
                .collect::<Result<_, _>>()?;
            Node::In {
                name,
                list,
                negated: *negated,
            }
        }
        Expr::Between {
            expr: inner,
            negated,
            low,
            high,
        } => {
            let number = |e: &Expr| match operand(e)? {
                Operand::Number(n) => Ok(n),
                _ => Err(refuse(e, "must be a number in BETWEEN")),
            };
            let operand = operand(inner)?;
            if !matches!(operand, Operand::Property(_)) {
                return Err(refuse(inner, "must be a property name before BETWEEN"));
            }
            Node::Between {
                operand,
                low: number(low)?,
                high: number(high)?,
                negated: *negated,
            }
        }
        Expr::IsNull(inner) | Expr::IsNotNull(inner) => {
            let Operand::Property(name) = operand(inner)? else {
                return Err(refuse(inner, "must be a property name before IS NULL"));
            };
            Node::IsNull {
                name,
                negated: matches!(expr, Expr::IsNotNull(_)),
            }
        }
        Expr::Value(v) if matches!(v.value, Value::Boolean(_)) => {
            Node::Constant(v.value == Value::Boolean(true))
        }
        other => return Err(refuse(other, &format!("is not a condition: {SUPPORTED}"))),
    })
}

fn operand(expr: &Expr) -> Result<Operand, FilterError> {
    Ok(match expr {
        Expr::Nested(inner) => operand(inner)?,
        Expr::Identifier(ident) => Operand::Property(ident.value.clone()),
        Expr::CompoundIdentifier(parts) => Operand::Property(
            parts
                .iter()
                .map(|p| p.value.as_str())
                .collect::<Vec<_>>()
                .join("."),
        ),
        Expr::Value(v) => match &v.value {
            Value::SingleQuotedString(s) => Operand::Text(s.clone()),
            Value::Number(n, _) => Operand::Number(
                n.parse()
                    .map_err(|_| refuse(n, "is not a number this filter can compare"))?,
            ),
            Value::Boolean(b) => Operand::Text(b.to_string()),
            Value::Null => {
                return Err(refuse(
                    expr,
                    "cannot be compared: use IS NULL or IS NOT NULL",
                ))
            }
            Value::DoubleQuotedString(s) => Operand::Property(s.clone()),
            _ => return Err(refuse(expr, "is not a literal this filter supports")),
        },
        Expr::UnaryOp {
            op: UnaryOperator::Minus,
            expr: inner,
        } => match operand(inner)? {
            Operand::Number(n) => Operand::Number(-n),
            _ => return Err(refuse(expr, "negates something that is not a number")),
        },
        Expr::UnaryOp {
            op: UnaryOperator::Plus,
            expr: inner,
        } => match operand(inner)? {
            n @ Operand::Number(_) => n,
            _ => return Err(refuse(expr, "is not a number")),
        },
        other => return Err(refuse(
            other,
            "is not a property, 'string' or number (arithmetic and functions are not supported)",
        )),
    })
}

/// A value an operand has for one record: None when a property is missing.
enum Resolved<'a> {
    Text(&'a str),
    Number(f64),
}

fn resolve<'a, 'b>(
    o: &'b Operand,
    property: &impl Fn(&str) -> Option<&'a str>,
) -> Option<Resolved<'b>>
where
    'a: 'b,
{
    match o {
        Operand::Property(name) => property(name).map(Resolved::Text),
        Operand::Text(s) => Some(Resolved::Text(s)),
        Operand::Number(n) => Some(Resolved::Number(*n)),
    }
}

fn number(r: &Resolved<'_>) -> Option<f64> {
    match r {
        Resolved::Number(n) => Some(*n),
        Resolved::Text(t) => t.trim().parse::<f64>().ok().filter(|n| n.is_finite()),
    }
}

/// Three-valued evaluation: Some(true), Some(false) or None (unknown).
fn eval<'a>(node: &Node, property: &impl Fn(&str) -> Option<&'a str>) -> Option<bool> {
    match node {
        Node::Constant(b) => Some(*b),
        Node::Not(inner) => eval(inner, property).map(|b| !b),
        Node::And(l, r) => match (eval(l, property), eval(r, property)) {
            (Some(false), _) | (_, Some(false)) => Some(false),
            (Some(true), Some(true)) => Some(true),
            _ => None,
        },
        Node::Or(l, r) => match (eval(l, property), eval(r, property)) {
            (Some(true), _) | (_, Some(true)) => Some(true),
            (Some(false), Some(false)) => Some(false),
            _ => None,
        },
        Node::IsNull { name, negated } => Some(property(name).is_none() != *negated),
        Node::In {
            name,
            list,
            negated,
        } => property(name).map(|v| list.iter().any(|s| s == v) != *negated),
        Node::Between {
            operand,
            low,
            high,
            negated,
        } => {
            let n = number(&resolve(operand, property)?)?;
            Some((*low <= n && n <= *high) != *negated)
        }
        Node::Compare(l, op, r) => {
            let (l, r) = (resolve(l, property)?, resolve(r, property)?);
            let numeric = matches!(l, Resolved::Number(_)) || matches!(r, Resolved::Number(_));
            let ordering = if numeric {
                number(&l)?.partial_cmp(&number(&r)?)?
            } else {
                match (&l, &r) {
                    (Resolved::Text(a), Resolved::Text(b)) => a.cmp(b),
                    _ => return None,
                }
            };
            Some(op.holds(ordering))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn props(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn check(filter: &str, pairs: &[(&str, &str)]) -> bool {
        let p = props(pairs);
        SqlFilter::parse(filter)
            .unwrap_or_else(|e| panic!("{filter}: {e}"))
            .matches(|k| p.get(k).map(String::as_str))
    }

    #[test]
    fn rocketmq_style_expressions_match_as_sql_says() {
        let eu = [("region", "eu"), ("amount", "150"), ("kind", "order")];
        assert!(check("region = 'eu' AND amount > 100", &eu));
        assert!(!check("region = 'eu' AND amount > 200", &eu));
        assert!(check("region <> 'us' OR amount < 0", &eu));
        assert!(check("NOT (region = 'us')", &eu));
        assert!(check("kind IN ('order', 'refund')", &eu));
        assert!(check("kind NOT IN ('refund')", &eu));
        assert!(check("amount BETWEEN 100 AND 150", &eu));
        assert!(!check("amount NOT BETWEEN 100 AND 150", &eu));
        assert!(check("missing IS NULL AND region IS NOT NULL", &eu));
        assert!(check("amount >= 150.0 AND amount <= 1.5e2", &eu));
        assert!(check("amount > -1", &eu));
        assert!(check("TRUE", &eu) && !check("FALSE", &eu));
        // A missing property is unknown: neither it nor its negation matches.
        assert!(!check("missing = 'x'", &eu));
        assert!(!check("NOT (missing = 'x')", &eu));
        assert!(check("missing = 'x' OR region = 'eu'", &eu));
        // A property that is not a number never compares as one.
        assert!(!check("region > 1", &eu) && !check("NOT (region > 1)", &eu));
        // Numbers compare numerically, strings exactly.
        assert!(check("amount = 150.00", &eu) && !check("amount = '150.00'", &eu));
    }

    #[test]
    fn bad_expressions_are_refused_naming_the_problem() {
        for (bad, says) in [
            ("", "empty"),
            ("region =", "Expected"),
            ("region = 'eu' garbage", "garbage"),
            ("amount + 1 > 2", "arithmetic"),
            ("region < 'x'", "need a number"),
            ("1 = 1", "two literals"),
            ("kind IN (1, 2)", "'string'"),
            ("amount BETWEEN 'a' AND 'b'", "number in BETWEEN"),
            ("region = NULL", "IS NULL"),
            ("region LIKE 'e%'", "not a condition"),
            ("upper(region) = 'EU'", "functions"),
            ("region", "not a condition"),
        ] {
            let e = SqlFilter::parse(bad).unwrap_err().0;
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let deep = format!("{}a = 1{}", "(".repeat(200), ")".repeat(200));
        assert!(
            SqlFilter::parse(&deep).is_err(),
            "deep nesting is refused, not a stack overflow"
        );
        assert!(
            SqlFilter::parse(&"a = 1 OR ".repeat(600)).is_err(),
            "over the length limit"
        );
        // A long flat expression within the limit parses and evaluates.
        let flat = format!("{}a = 1", "a = 0 OR ".repeat(400));
        let f = SqlFilter::parse(&flat).unwrap();
        assert!(f.matches(|_| Some("1")) && !f.matches(|_| Some("2")));
    }

    proptest! {
        #[test]
        fn any_text_is_parsed_or_refused_without_panicking(text in ".{0,80}") {
            if let Ok(f) = SqlFilter::parse(&text) {
                let _ = f.matches(|_| Some("1"));
                let _ = f.matches(|_| None);
            }
        }

        #[test]
        fn numeric_comparisons_agree_with_rust(a in -1e6f64..1e6, b in -1e6f64..1e6) {
            let p = props(&[("x", &a.to_string())]);
            let get = |k: &str| p.get(k).map(String::as_str);
            for (op, want) in [("<", a < b), ("<=", a <= b), (">", a > b), (">=", a >= b), ("=", a == b), ("<>", a != b)] {
                let f = SqlFilter::parse(&format!("x {op} {b}")).unwrap();
                prop_assert_eq!(f.matches(get), want, "x={} {} {}", a, op, b);
            }
        }

        #[test]
        fn not_is_the_complement_when_the_property_is_present(v in "[a-z]{1,4}", lit in "[a-z]{1,4}") {
            let p = props(&[("p", &v)]);
            let get = |k: &str| p.get(k).map(String::as_str);
            let f = SqlFilter::parse(&format!("p = '{lit}'")).unwrap();
            let g = SqlFilter::parse(&format!("NOT (p = '{lit}')")).unwrap();
            prop_assert_ne!(f.matches(get), g.matches(get));
        }
    }
}
